"""worker/grammar.py's compile lanes and patience, with compiles made slow on purpose and a fake clock: a trivial
constraint never waits behind a huge schema, a compile past its patience is answered as refused (and its late
result is never kept), and over-long compiles still running are bounded."""

import json
import threading
import time

from shuttle.common.messages import CONSTRAINT_REFUSAL
from shuttle.common.sampling import StructuredOutput
from shuttle.worker.grammar import COMPILE_PATIENCE_S, LARGE_SPEC_BYTES, MAX_ABANDONED, GrammarCompiler
from tests.server import MODEL_DIR

HANG = 30.0  # a bound only a hang reaches


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def large(i: int) -> StructuredOutput:
    """A spec for the large lane that compiles at once (its bulk is a description)."""
    return StructuredOutput(kind="json", spec=json.dumps({"type": "string", "maxLength": i + 1,
                                                "description": "x" * LARGE_SPEC_BYTES}))


def small(i: int) -> StructuredOutput:
    return StructuredOutput(kind="regex", spec=f"[a-z]{{{i}}}")


def compiler_with_gates(clock):
    """A GrammarCompiler whose large compiles wait on a gate each (released by the test)."""
    compiler = GrammarCompiler(str(MODEL_DIR), 512, (2,), clock=clock)
    real, gates = compiler._compile, {}

    def gated(spec):
        if len(spec.spec) >= LARGE_SPEC_BYTES:
            gates.setdefault(spec.key, threading.Event()).wait(HANG)
        return real(spec)
    compiler._compile = gated
    return compiler, gates


def answers_until(compiler, keys: set[str]) -> dict[str, str]:
    got, deadline = {}, time.monotonic() + HANG
    while not keys <= got.keys():
        assert time.monotonic() < deadline, f"no answer for {keys - got.keys()}"
        answered = compiler.take_finished()
        if answered is not None:
            got.update(zip(answered.keys, answered.errors))
        time.sleep(0.005)
    return got


def test_a_small_constraint_is_answered_while_a_large_one_compiles():
    compiler, gates = compiler_with_gates(Clock())
    compiler.submit([large(1)])
    compiler.submit([small(1)])
    assert answers_until(compiler, {small(1).key}) == {small(1).key: ""}
    assert compiler.has_pending  # the large one still compiles
    gates.setdefault(large(1).key, threading.Event()).set()
    assert answers_until(compiler, {large(1).key}) == {large(1).key: ""}
    assert compiler.resident_keys == {small(1).key, large(1).key}


def test_a_compile_past_its_patience_is_refused_and_its_late_result_dropped():
    clock = Clock()
    compiler, gates = compiler_with_gates(clock)
    compiler.submit([large(1), large(2)])  # the second waits in the large lane
    compiler.take_finished()
    clock.now += 20
    compiler.submit([large(3)])  # queued 20 s after them
    clock.now += COMPILE_PATIENCE_S - 20 + 1
    answered = compiler.take_finished()
    errors = dict(zip(answered.keys, answered.errors))
    statuses = dict(zip(answered.keys, answered.statuses or [400] * len(answered.keys)))
    assert sorted(errors) == sorted([large(1).key, large(2).key])
    assert CONSTRAINT_REFUSAL in errors[large(1).key] and "within 30 s" in errors[large(1).key]
    assert statuses[large(1).key] == 400  # this spec: it compiled for its whole patience
    # a fresh-clone trial: queued behind over-long compiles, the fourth of four waited 90 s for its answer; a request
    # waits for its compile to start no longer than for the compile
    assert "waited 30 s behind other compiles" in errors[large(2).key] and statuses[large(2).key] == 503
    gates.setdefault(large(3).key, threading.Event()).set()  # the lane went on with the next in time
    assert answers_until(compiler, {large(3).key}) == {large(3).key: ""}
    gates[large(1).key].set()  # the abandoned compile ends: nobody is told, nothing is kept
    deadline = time.monotonic() + HANG
    while compiler._abandoned and time.monotonic() < deadline:
        compiler.take_finished()
        time.sleep(0.005)
    assert large(1).key not in compiler.resident_keys and compiler.take_finished() is None


def test_past_the_bound_of_over_long_compiles_large_ones_are_refused_at_once_and_small_ones_go_on():
    clock = Clock()
    compiler, gates = compiler_with_gates(clock)
    for i in range(MAX_ABANDONED):
        compiler.submit([large(i)])
        compiler.take_finished()
        clock.now += COMPILE_PATIENCE_S + 1
        assert compiler.take_finished().keys == [large(i).key]
    compiler.submit([large(99), small(5)])
    got, statuses = {}, {}
    deadline = time.monotonic() + HANG
    while not {large(99).key, small(5).key} <= got.keys():
        assert time.monotonic() < deadline
        answered = compiler.take_finished()
        if answered is not None:
            got.update(zip(answered.keys, answered.errors))
            statuses.update(zip(answered.keys, answered.statuses or [0] * len(answered.keys)))
        time.sleep(0.005)
    assert "over-long compiles" in got[large(99).key] and got[small(5).key] == ""
    assert statuses[large(99).key] == 503  # not now, rather than not this spec: its requests get 503
    for gate in gates.values():
        gate.set()
    while compiler._abandoned and time.monotonic() < deadline:
        compiler.take_finished()
        time.sleep(0.005)
    compiler.submit([large(99)])  # once they ended, the same spec compiles: the refusal was not kept for it
    gates.setdefault(large(99).key, threading.Event()).set()
    assert answers_until(compiler, {large(99).key}) == {large(99).key: ""}
