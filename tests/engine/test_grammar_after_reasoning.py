"""A reasoning model's structured output in the in-process engine (scheduler + ModelRunner, no sockets) on
stories260K: with StructuredOutput.starts_after, the tokens up to and including the first such token are free
(the thinking) and the grammar governs exactly the tokens after it, under overlapped scheduling and preemption.

stories260K has no `</think>` token; the worker's rule is by token id, so "." (id 426, which the model writes within
a few tokens) stands for it here. frontend/reasoning/ sends the model's real end-of-thinking id
(tests/api/test_reasoning.py)."""

import json

import jsonschema
import pytest

from shuttle.common.messages import FinishReason
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.tokenizer import TextTokenizer
from tests.engine.test_structured_engine import _run
from tests.server import MODEL_DIR

END_OF_THINKING = 426  # "."
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}


def _spec(starts_after=END_OF_THINKING):
    return StructuredOutput(kind="json", spec=json.dumps(SCHEMA), starts_after=starts_after)


@pytest.mark.parametrize("mode", ["overlapped", "preempting"])
def test_the_grammar_governs_only_what_follows_the_end_of_thinking(mode):
    tokenizer = TextTokenizer(MODEL_DIR)
    kwargs = {"overlapped": {}, "preempting": {"num_blocks": 24}}[mode]
    results, scheduler = _run([_spec()] * 12, max_tokens=120, **kwargs)
    thought = []
    for entry in results:
        ids = entry["ids"]
        assert entry["finish"] == FinishReason.STOP, entry
        assert END_OF_THINKING in ids, entry  # every seed reaches a "." well within 120 tokens
        end = ids.index(END_OF_THINKING)
        answer = [t for t in ids[end + 1:] if t != 2]
        jsonschema.validate(json.loads(tokenizer.decode(answer)), SCHEMA)
        thought.append(tokenizer.decode(ids[:end]))
    # the thinking is the model's own free text, never the grammar's: no JSON object starts it
    assert all(text and not text.lstrip().startswith("{") for text in thought), thought
    if mode == "preempting":
        assert scheduler.num_preemptions > 0


def test_without_starts_after_the_grammar_governs_from_the_first_token():
    tokenizer = TextTokenizer(MODEL_DIR)
    results, _ = _run([_spec(None)] * 4, max_tokens=120)
    for entry in results:
        jsonschema.validate(json.loads(tokenizer.decode([t for t in entry["ids"] if t != 2])), SCHEMA)
