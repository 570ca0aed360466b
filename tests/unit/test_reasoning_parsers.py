"""--reasoning-parser's formats (frontend/reasoning/) as units: a whole output split into thinking and answer, the
same output streamed in any pieces adding up to the same split, what a prompt says about thinking, the thinking's
token count, and the parser a tokenizer gets (none, logged, when it has no think tokens)."""

import itertools
import logging

import pytest

from shuttle.common.api_config import REASONING_PARSERS
from shuttle.frontend.reasoning import PARSERS, DeepSeekR1Parser, Qwen3Parser, reasoning_parser_of
from shuttle.frontend.tokenizer import TextTokenizer
from tests.server import MODEL_DIR

START, END = 600, 601  # the tags' token ids in these units
R1, QWEN3 = DeepSeekR1Parser(START, END), Qwen3Parser(START, END)

# (output, (reasoning, content)) of an output that thinks, for both parsers
SPLITS = [
    ("Hmm, 2 + 2.</think>4", ("Hmm, 2 + 2.", "4")),  # the template opened the thinking: no <think>
    ("<think>Hmm.</think>\n\n4", ("Hmm.", "\n\n4")),  # the model opened it itself
    ("\n<think>Hmm.</think>4", ("\nHmm.", "4")),  # text before <think> is thinking too
    ("Hmm, still", ("Hmm, still", None)),  # cut while thinking: all reasoning, no content
    ("<think>Hmm", ("Hmm", None)),
    ("Hmm.</think>", ("Hmm.", None)),  # nothing after the thinking
    ("</think>4", ("", "4")),  # an empty thinking
    ("a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),  # tags after the end are the answer's text
    ("<think>a<think>b</think>c", ("a<think>b", "c")),  # only the first <think> is dropped
    ("a </thin", ("a </thin", None)),  # a tag's beginning at the end stays text
    ("<", ("<", None)),
    ("", ("", None)),
]


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text,expected", SPLITS)
def test_a_whole_output_splits_into_thinking_and_answer(parser, text, expected):
    assert parser.split(text, thinking=True) == expected


@pytest.mark.parametrize("text,expected", SPLITS)
def test_every_streamed_split_of_an_output_adds_up_to_its_whole_split(text, expected):
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        bounds = [0, *cuts, len(text)]
        stream = R1.stream(thinking=True)
        pieces = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [stream.finish()]
        reasoning, content = "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)
        assert (reasoning, content if stream.ended and content else None) == expected, cuts


def test_a_stream_holds_back_only_what_may_still_be_a_tag():
    stream = R1.stream(thinking=True)
    assert (stream.feed("Hmm </th").reasoning, stream.feed("ink").reasoning) == ("Hmm ", "")
    piece = stream.feed(">Yes")
    assert (piece.reasoning, piece.content, stream.ended) == ("", "Yes", True)
    assert stream.feed(" </think> too").content == " </think> too"
    other = R1.stream(thinking=True)
    assert other.feed("a </").reasoning == "a " and other.feed("b").reasoning == "</b"  # it was no tag
    assert other.finish().reasoning == ""
    cut = R1.stream(thinking=True)
    assert cut.feed("a </thi").reasoning == "a " and cut.finish().reasoning == "</thi"  # the end shows it


def test_an_output_that_does_not_think_is_all_content():
    assert R1.split("<think>Hmm.</think>4", thinking=False) == (None, "<think>Hmm.</think>4")
    stream = R1.stream(thinking=False)
    assert stream.feed("a</think>b").content == "a</think>b" and stream.finish().content == ""


def test_the_prompt_says_whether_the_output_thinks():
    # the last tag of the prompt decides (vLLM's is_reasoning_end): an open <think> thinks, a closed one does not
    assert R1.thinks([1, 5, START], None) and R1.thinks([1, 5], None)
    assert not R1.thinks([1, START, 7, END, 9], None)
    assert R1.thinks([1, START, 7, END, 9, START], None)
    assert R1.thinks([1, 5], {"enable_thinking": False})  # deepseek_r1 reads no switch
    assert not QWEN3.thinks([1, 5], {"enable_thinking": False})
    assert QWEN3.thinks([1, 5], {"enable_thinking": True}) and QWEN3.thinks([1, 5], {})
    assert not QWEN3.thinks([1, START, 7, END], {"enable_thinking": True})


def test_reasoning_tokens_are_those_before_the_end_tag():
    assert R1.count_reasoning_tokens([START, 5, 6, END, 7, 8], thinking=True) == 2
    assert R1.count_reasoning_tokens([5, 6, 7], thinking=True) == 3  # never ended
    assert R1.count_reasoning_tokens([END, 7], thinking=True) == 0
    assert R1.count_reasoning_tokens([5, END, 7], thinking=False) == 0


def test_every_reasoning_parser_flag_has_a_parser():
    assert set(REASONING_PARSERS) == PARSERS.keys()


def test_a_tokenizer_without_think_tokens_gets_no_parser_and_says_so(caplog):
    tokenizer = TextTokenizer(str(MODEL_DIR))  # stories260K: no <think>, no </think>
    assert reasoning_parser_of(None, tokenizer) is None
    with caplog.at_level(logging.WARNING, logger="shuttle.frontend"):
        assert reasoning_parser_of("deepseek_r1", tokenizer) is None
    assert [r.getMessage() for r in caplog.records] == [
        "--reasoning-parser deepseek_r1: the model's tokenizer has no <think> and </think> token, so the model "
        "cannot mark its thinking: its whole output is served as content"]
