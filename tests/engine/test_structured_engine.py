"""Grammar-constrained decoding in the in-process engine (scheduler + ModelRunner, no sockets) on stories260K:
sampled outputs (temperature 1.0) always follow their JSON schema, regex or choice, under overlapped scheduling,
preemption (a cache too small for the batch) and prefix caching; bad constraints end with 400 before running."""

import json
import re
import time

import jsonschema
import pytest

from shuttle.common.messages import FinishReason, GrammarsCompiled, Submit
from shuttle.common.sampling import SamplingParams, StructuredOutput
from shuttle.frontend.tokenizer import TextTokenizer
from tests.engine.test_engine_inprocess import drive, make_engine, terminal_collector
from tests.server import MODEL_DIR

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "sleepy"]},
        "height": {"type": "number"},
        "pets": {"type": "array", "maxItems": 3,
                 "items": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                            "legs": {"type": "integer", "minimum": 0,
                                                                     "maximum": 8}},
                           "required": ["kind", "legs"], "additionalProperties": False}},
    },
    "required": ["name", "age", "mood", "pets"],
    "additionalProperties": False,
}
PROMPT_IDS = [1, 403, 407, 261, 378]  # "<s>Once upon a time"-like opening; the grammar decides the rest


def _run(specs, num_blocks=256, max_batched=64, prefix_caching=True, max_in_flight=2, max_tokens=400, seeds=None):
    """Outputs (token ids, finish reason, error) per request of a fresh engine, one request per spec."""
    scheduler, runner = make_engine(num_blocks, max_batched, prefix_caching)
    results = {str(i): {"ids": [], "finish": None, "error": ""} for i in range(len(specs))}

    def collect(batch):
        for out in batch:
            entry = results[out.request_id]
            assert entry["finish"] is None, "a request got a second terminal output"
            entry["ids"] += out.new_token_ids
            if out.finish_reason is not None:
                entry["finish"], entry["error"] = out.finish_reason, out.error_message

    for i, spec in enumerate(specs):
        seed = seeds[i] if seeds else i
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=spec)
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=PROMPT_IDS, sampling=params,
                                           arrival_time=time.time()))
    drive(scheduler, runner, collect, max_in_flight)
    assert scheduler.kv.pool.num_free == num_blocks
    return [results[str(i)] for i in range(len(specs))], scheduler


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(MODEL_DIR)


def _text(tokenizer, ids):
    return tokenizer.decode([t for t in ids if t != 2])


def _json_spec(schema=SCHEMA):
    return StructuredOutput(kind="json", spec=json.dumps(schema))


@pytest.mark.parametrize("mode", ["overlapped", "preempting", "no_prefix_cache", "one_in_flight"])
def test_sampled_json_always_follows_the_schema(tokenizer, mode):
    kwargs = {"overlapped": {}, "preempting": {"num_blocks": 40}, "no_prefix_cache": {"prefix_caching": False},
              "one_in_flight": {"max_in_flight": 1}}[mode]
    results, scheduler = _run([_json_spec()] * 16, **kwargs)
    for entry in results:
        assert entry["finish"] == FinishReason.STOP, entry
        jsonschema.validate(json.loads(_text(tokenizer, entry["ids"])), SCHEMA)
    if mode == "preempting":
        assert scheduler.num_preemptions > 0


def test_regex_and_choice_outputs_match(tokenizer):
    regex = StructuredOutput(kind="regex", spec=r"(yes|no), [a-z]{2,8} [0-9]{1,3}")
    choices = ["the cat", "a dog", "Lily and Tom"]
    choice = StructuredOutput(kind="choice", spec=json.dumps(choices))
    results, _ = _run([regex] * 8 + [choice] * 8)
    texts = [_text(tokenizer, e["ids"]) for e in results]
    assert all(e["finish"] == FinishReason.STOP for e in results)
    assert all(re.fullmatch(r"(yes|no), [a-z]{2,8} [0-9]{1,3}", t) for t in texts[:8]), texts[:8]
    assert all(t in choices for t in texts[8:]), texts[8:]


def test_max_tokens_cut_ends_with_length():
    results, _ = _run([_json_spec()] * 2, max_tokens=5)
    assert [(len(e["ids"]), e["finish"]) for e in results] == [(5, FinishReason.LENGTH)] * 2


def test_constrained_and_free_requests_share_a_batch(tokenizer):
    scheduler, runner = make_engine(256, 64)
    out = {"free": [], "json": []}
    finish = {}

    def collect(batch):
        for o in batch:
            out[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finish[o.request_id] = o.finish_reason

    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    scheduler.add_request(b"c", Submit(request_id="free", prompt_token_ids=PROMPT_IDS, sampling=greedy,
                                       arrival_time=time.time()))
    scheduler.add_request(
        b"c",
        Submit(
            request_id="json",
            prompt_token_ids=PROMPT_IDS,
            sampling=SamplingParams(max_tokens=400, seed=3, structured=_json_spec()),
            arrival_time=time.time(),
        ),
    )
    drive(scheduler, runner, collect)
    alone, _ = _run_greedy_alone(greedy)
    assert out["free"] == alone  # the constrained neighbour changed nothing of the free request's tokens
    jsonschema.validate(json.loads(_text(tokenizer, out["json"])), SCHEMA)


def _run_greedy_alone(params):
    scheduler, runner = make_engine(256, 64)
    ids = []
    drive(scheduler, runner, lambda batch: ids.extend(t for o in batch for t in o.new_token_ids))
    scheduler.add_request(
        b"c", Submit(request_id="x", prompt_token_ids=PROMPT_IDS, sampling=params, arrival_time=time.time())
    )
    drive(scheduler, runner, lambda batch: ids.extend(t for o in batch for t in o.new_token_ids))
    return ids, scheduler


@pytest.mark.parametrize(
    "spec, reason",
    [
        (StructuredOutput(kind="json", spec='{"type": "object", "properties": {"a": {"type": "strin"}}}'), "strin"),
        (StructuredOutput(kind="regex", spec="[a-"), "regex"),
        (StructuredOutput(kind="grammar", spec='root ::= "a" | '), "grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_ends_with_400_before_running(spec, reason):
    results, scheduler = _run([spec, _json_spec()])
    bad, good = results
    assert bad["finish"] == FinishReason.ERROR and bad["ids"] == []
    assert reason in bad["error"], bad["error"]
    assert ".cc:" not in bad["error"] and not re.search(r"\[\d\d:\d\d:\d\d\]", bad["error"])  # no C++ log prefix
    assert good["finish"] == FinishReason.STOP
    assert scheduler.num_waiting == 0


def test_equal_constraints_compile_once_and_wait_outside_the_queue():
    scheduler, runner = make_engine(256, 64)
    spec = _json_spec()
    for i in range(3):
        scheduler.add_request(
            b"c",
            Submit(
                request_id=str(i),
                prompt_token_ids=PROMPT_IDS,
                sampling=SamplingParams(structured=spec),
                arrival_time=time.time(),
            ),
        )
    assert scheduler.grammars.take_requests() == [spec]  # one compile for three requests
    assert len(scheduler.waiting) == 0 and scheduler.grammars.num_held == 3 and scheduler.num_waiting == 3
    assert scheduler.schedule().is_empty  # nothing runs before the grammar is ready
    scheduler.abort(["1"])
    scheduler.on_grammars_compiled(GrammarsCompiled(keys=[spec.key], errors=[""]))
    assert len(scheduler.waiting) == 2 and scheduler.grammars.num_held == 0
    scheduler.add_request(
        b"c",
        Submit(
            request_id="3",
            prompt_token_ids=PROMPT_IDS,
            sampling=SamplingParams(structured=spec),
            arrival_time=time.time(),
        ),
    )
    assert len(scheduler.waiting) == 3 and scheduler.grammars.take_requests() == []  # known ready: no round trip


def regex_spec(i: int) -> StructuredOutput:
    return StructuredOutput(kind="regex", spec=f"[a-z]{{{i + 1}}}")


def test_the_gate_never_evicts_the_grammar_of_a_queued_or_running_request():
    """The repro of a client's schema stopping the engine: a request queued with its grammar compiled, then more
    distinct grammars than the cache holds pass through. The queued request's grammar stays pinned (never in an
    eviction), and goes once the request ends; the worker's copy follows the gate's book exactly."""
    scheduler, runner = make_engine(256, 64)
    gate = scheduler.grammars = type(scheduler.grammars)(cache_entries=2)
    waiting = regex_spec(0)

    runner.grammars.evict(list(runner.grammars.resident_keys))  # the runner is shared with earlier tests

    def settle():  # the served loop's exchange with the worker, until nothing is left to send
        while True:
            specs, evict = gate.take_requests(), gate.take_evictions()
            if not specs and not evict:
                break
            assert waiting.key not in evict or not gate.pins(waiting.key)
            scheduler.on_grammars_compiled(runner.grammars.compile_now(specs, evict))
        assert runner.grammars.resident_keys == set(gate.resident)

    scheduler.add_request(
        b"c",
        Submit(
            request_id="queued",
            prompt_token_ids=PROMPT_IDS,
            sampling=SamplingParams(structured=waiting),
            arrival_time=time.time(),
        ),
    )
    settle()
    assert gate.pins(waiting.key) == 1 and len(scheduler.waiting) == 1
    for i in range(1, 8):  # each compiles, passes the gate and ends: unpinned, evicted beyond two entries
        scheduler.add_request(
            b"c",
            Submit(
                request_id=f"r{i}",
                prompt_token_ids=PROMPT_IDS,
                sampling=SamplingParams(structured=regex_spec(i)),
                arrival_time=time.time(),
            ),
        )
        settle()
        scheduler.abort([f"r{i}"])
        settle()
    assert waiting.key in gate.resident and len(gate.resident) == 2
    scheduler.abort(["queued"])
    scheduler.add_request(
        b"c",
        Submit(
            request_id="r8",
            prompt_token_ids=PROMPT_IDS,
            sampling=SamplingParams(structured=regex_spec(8)),
            arrival_time=time.time(),
        ),
    )
    settle()
    assert waiting.key not in runner.grammars.resident_keys and gate.pins(waiting.key) == 0


def test_many_distinct_grammars_through_a_tiny_cache_never_compile_on_the_step():
    """Twelve requests over six distinct regexes through a gate that keeps two unpinned grammars, under overlapped
    scheduling: every output follows its regex and no grammar is compiled on the step."""
    scheduler, runner = make_engine(256, 64)
    scheduler.grammars = type(scheduler.grammars)(cache_entries=2)
    results = {}
    step_compiles = runner.grammars.step_compiles  # the runner is shared with earlier tests

    def collect(batch):
        for out in batch:
            results.setdefault(out.request_id, []).extend(out.new_token_ids)

    for i in range(12):
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=i, structured=regex_spec(i % 6))
        scheduler.add_request(
            b"c", Submit(request_id=str(i), prompt_token_ids=PROMPT_IDS, sampling=params, arrival_time=time.time())
        )
    drive(scheduler, runner, collect, 2)
    tok = TextTokenizer(MODEL_DIR)
    for i in range(12):
        assert re.fullmatch(f"[a-z]{{{i % 6 + 1}}}", tok.decode(results[str(i)], skip_special_tokens=True))
    assert runner.grammars.step_compiles == step_compiles


@pytest.mark.parametrize("spec", [StructuredOutput(kind="regex", spec=r"[^\s\S]"),
                                  StructuredOutput(kind="regex", spec=r"ab[^\w\W]")])
def test_a_constraint_that_admits_no_token_ends_its_request_alone_with_400(spec):
    """A constraint that compiles but matches no text (at once, or after a prefix): when its mask leaves no token,
    its request ends with one 400; the free request in the same steps goes on to the end, token for token."""
    scheduler, runner = make_engine(256, 64)
    out, ends, collect = terminal_collector("free", "empty")
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    scheduler.add_request(b"c", Submit(request_id="free", prompt_token_ids=PROMPT_IDS, sampling=greedy,
                                       arrival_time=time.time()))
    scheduler.add_request(b"c", Submit(request_id="empty", prompt_token_ids=PROMPT_IDS, arrival_time=time.time(),
                                       sampling=SamplingParams(max_tokens=20, temperature=0.0, structured=spec)))
    drive(scheduler, runner, collect)
    alone, _ = _run_greedy_alone(greedy)
    assert out["free"] == alone and ends["free"].finish_reason == FinishReason.LENGTH
    empty = ends["empty"]
    assert (empty.finish_reason, empty.error_status) == (FinishReason.ERROR, 400)
    assert "constraint admits no token at output position" in empty.error_message
    assert scheduler.kv.pool.num_free == 256 and not scheduler.requests
