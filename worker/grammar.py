"""Grammar-constrained decoding: compiling a request's StructuredOutput with xgrammar, one matcher per request,
and the batched mask that keeps every sampled token inside its grammar.

Who does what (the scheduler never sees a grammar): the scheduler holds a constrained request back until its
grammar is compiled (scheduler/grammar_gate.py), asking this worker to compile it (CompileGrammars) and telling it
which compiled grammars to drop; compiles run on threads of their own (xgrammar releases the GIL), so the step loop
goes on, and GrammarsCompiled tells the scheduler when each is ready or why it failed. The matcher lives here, beside
the sampler, because only here is a sampled token known at once: under overlapped scheduling the next step is planned
before the scheduler has seen this one's tokens, and the mask of a decode must follow the token sampled just before it.
A request that comes back after a preemption replays its known outputs into a new matcher, so recomputation needs no
grammar state on the wire.

xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models",
2024; https://github.com/mlc-ai/xgrammar) does the compiling, matching and mask application.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Sequence

import torch

from shuttle.common.messages import CONSTRAINT_REFUSAL, GRAMMAR_CACHE_ENTRIES, GrammarsCompiled
from shuttle.common.sampling import StructuredOutput

if TYPE_CHECKING:  # for annotations only: xgrammar is imported where it is first used
    from xgrammar import CompiledGrammar

log = logging.getLogger("shuttle.worker")

# Compiled grammars stay until the scheduler evicts them (scheduler/grammar_gate.py keeps the book); the reasons
# constraints did not compile are small and kept, most recent first, up to this many.
ERROR_CACHE_ENTRIES = 2 * GRAMMAR_CACHE_ENTRIES
MAX_ERROR_CHARS = 500  # of xgrammar's message, in the 400 a client gets
# xgrammar's C++ messages start with its log prefix, "[15:40:37] /project/cpp/json_schema_converter.cc:5082: ": a
# time and a source path of its build, nothing a client can act on
XGRAMMAR_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")


# Compiles run in two lanes, each one compile at a time on a thread of its own (xgrammar releases the GIL): specs
# under LARGE_SPEC_BYTES in one, larger ones in the other, so a trivial constraint never waits behind a huge schema.
# A compile still running after COMPILE_PATIENCE_S is answered as refused (a 400 naming the field) and left to finish
# unseen, and its lane goes on with the next one; at most MAX_ABANDONED such compiles may still run, and past that
# the large lane refuses at once until one ends (each holds a core until xgrammar returns). A compile still queued
# after COMPILE_PATIENCE_S (behind others) is refused as busy (503), so a request waits at most about twice that.
LARGE_SPEC_BYTES = 16 * 1024
COMPILE_PATIENCE_S = 30.0
MAX_ABANDONED = 2


class GrammarError(ValueError):
    """A StructuredOutput xgrammar cannot compile (the message says why). `status` 503: not now (the server is busy
    with over-long compiles), never kept for the spec; 400: not this spec."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class _Job:
    """One compile: its spec, its thread once started, and its result once done."""

    def __init__(self, spec: StructuredOutput, queued: float):
        self.spec = spec
        self.queued = queued  # when it joined its lane's queue (the compiler's clock)
        self.started = 0.0
        self.thread: threading.Thread | None = None
        self.result: CompiledGrammar | GrammarError | None = None
        self.done = threading.Event()


class _Lane:
    """Compiles waiting in order, and the one running."""

    def __init__(self) -> None:
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None


class GrammarCompiler:
    """Compiles StructuredOutputs for one model's vocabulary, off the step loop, and keeps them by key until the
    scheduler evicts them (scheduler/grammar_gate.py keeps the book).

    JSON is compiled without free whitespace (xgrammar's `any_whitespace=False`: ", " and ": " between items), so a
    model cannot spend its max_tokens on blank lines inside an object, which small and sampled models otherwise do.

    Args:
        tokenizer_dir: the Hugging Face tokenizer's directory (transformers' AutoTokenizer loads it once, on a
            thread of its own, as soon as the compiler is built).
        vocab_size: the logits' width (the model's output rows; may exceed the tokenizer's vocabulary).
        eos_token_ids: the ids that end a sequence: a grammar allows them exactly where its output may end.
        trust_remote_code: passed to AutoTokenizer.
        patience_s: seconds a compile may run before it is answered as refused (COMPILE_PATIENCE_S).
        clock: time source in seconds (time.monotonic; tests pass their own).
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 trust_remote_code: bool = False, patience_s: float = COMPILE_PATIENCE_S, clock=time.monotonic):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.trust_remote_code = trust_remote_code
        self.patience_s = patience_s
        self.clock = clock
        self._info = None  # xgrammar.TokenizerInfo, built on first use
        self._build_lock = threading.Lock()
        self._cache: dict[str, object] = {}  # key -> CompiledGrammar, until the scheduler evicts it
        self._errors: OrderedDict[str, GrammarError] = OrderedDict()  # key -> why it does not compile
        self._cache_lock = threading.Lock()
        self.step_compiles = 0  # grammars compiled on the step: missing when a request needed them (never, by design)
        self._lanes = (_Lane(), _Lane())  # small specs, large specs
        self._jobs: dict[str, _Job] = {}  # key -> its job, queued or running
        self._abandoned: list[_Job] = []  # compiles past their patience, still running
        self._answers: list[tuple[str, CompiledGrammar | GrammarError]] = []  # cache hits included
        # The tokenizer's grammar tables are built now, on a thread, so no first request waits for them
        threading.Thread(target=self._warm_up, name="grammar-warm-up", daemon=True).start()

    # ---- asked by the scheduler -------------------------------------------------------------------------

    def submit(self, specs: list[StructuredOutput], evict: Sequence[str] = ()) -> None:
        """Drop the compiled grammars keyed `evict`, then start compiling each spec not compiled or compiling yet;
        each spec is answered by `take_finished`."""
        self.evict(evict)
        for spec in specs:
            key = spec.key
            cached = self._cached(key)
            if cached is not None:
                self._answers.append((key, cached))
            elif key not in self._jobs:
                job = self._jobs[key] = _Job(spec, self.clock())
                self._lanes[len(spec.spec) >= LARGE_SPEC_BYTES].queue.append(job)
        self._pump()

    def evict(self, keys: Sequence[str]) -> None:
        """Drop these compiled grammars (the scheduler's word: no queued or running request needs them)."""
        with self._cache_lock:
            for key in keys:
                self._cache.pop(key, None)

    @property
    def resident_keys(self) -> set[str]:
        """The keys of the compiled grammars held now."""
        with self._cache_lock:
            return set(self._cache)

    @property
    def has_pending(self) -> bool:
        """Compiles queued or running, or answers not yet taken (the worker loop polls instead of blocking)."""
        return bool(self._jobs or self._answers)

    def take_finished(self) -> GrammarsCompiled | None:
        """The answers since the last call (None when there are none): finished compiles, and refusals of those past
        their patience."""
        now = self.clock()
        for lane in self._lanes:
            job = lane.running
            if job is None:
                continue
            if job.done.is_set():
                self._settle(job, job.result)
                lane.running = None
            elif now - job.started > self.patience_s:
                self._abandoned.append(job)
                self._settle(job, GrammarError(
                    f"the {job.spec.kind} {CONSTRAINT_REFUSAL} within {self.patience_s:g} s (the server's limit on "
                    f"one compile): make it smaller or simpler"))
                lane.running = None
        self._pump()
        if not self._answers:
            return None
        answers, self._answers = self._answers, []
        return _answer(answers)

    def compile_now(self, specs: list[StructuredOutput], evict: Sequence[str] = ()) -> GrammarsCompiled:
        """`submit`, compiling on the caller's thread and answering every spec (the in-process engine,
        scheduler/in_process.py)."""
        self.evict(evict)
        answers = []
        for spec in specs:
            value = self._cached(spec.key)
            if value is None:
                value = self._compile_or_error(spec)
                self._keep(spec.key, value)
            answers.append((spec.key, value))
        return _answer(answers)

    # ---- used by the step -------------------------------------------------------------------------------

    def matcher(self, spec: StructuredOutput, outputs: list[int]) -> GrammarState:
        """A fresh matcher for `spec` that has accepted `outputs` (the request's known output tokens: more than none
        after a preemption). The grammar is compiled already (the scheduler let the request run only once it was,
        and keeps it here while the request lives); if it were not, it would be compiled on the spot (counted in
        `step_compiles`, logged as the bug it is).

        Raises:
            GrammarError: the spec does not compile, or `outputs` do not follow it (a bug: they were sampled under it).
        """
        import xgrammar as xgr

        compiled = self._cached(spec.key)
        if compiled is None:  # the scheduler pins a queued request's grammar: only a bug gets here
            self.step_compiles += 1
            log.error("grammar %s is not compiled when its request runs: compiling it on the step", spec.key[:16])
            compiled = self._compile_or_error(spec)
            self._keep(spec.key, compiled)
        if isinstance(compiled, GrammarError):
            raise compiled
        state = GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=self.eos_token_ids or None),
                             self.eos_token_ids, spec.starts_after)
        for position, token in enumerate(outputs):
            if not state.accept(token):
                raise GrammarError(f"output token {token} at position {position} does not follow the grammar")
        return state

    def close(self) -> None:
        """Nothing to stop: compile threads are daemons, and a compile's result is only read by take_finished."""

    # ---- compiling --------------------------------------------------------------------------------------

    def _cached(self, key: str):
        """The CompiledGrammar or GrammarError of `key`, or None."""
        with self._cache_lock:
            return self._cache.get(key) or self._errors.get(key)

    def _keep(self, key: str, value) -> None:
        with self._cache_lock:
            if isinstance(value, GrammarError):
                self._errors[key] = value
                while len(self._errors) > ERROR_CACHE_ENTRIES:
                    self._errors.popitem(last=False)
            else:
                self._cache[key] = value

    def _settle(self, job: _Job, value) -> None:
        """A job's answer: kept (a compiled grammar, until evicted; an error, among the recent ones) and reported."""
        del self._jobs[job.spec.key]
        if value is None:
            value = GrammarError("internal error: the compile ended without a result")
        if not (isinstance(value, GrammarError) and value.status == 503):  # busy now: the next ask compiles
            self._keep(job.spec.key, value)
        self._answers.append((job.spec.key, value))

    def _pump(self) -> None:
        """Start the next queued compile of each idle lane; past MAX_ABANDONED over-long compiles still running,
        the large lane's queue is refused instead."""
        self._abandoned = [job for job in self._abandoned if not job.done.is_set()]
        now = self.clock()
        for lane in self._lanes:  # a request waits for its grammar's compile to start no longer than for the compile
            while lane.queue and now - lane.queue[0].queued > self.patience_s:
                self._settle(lane.queue.popleft(), GrammarError(
                    f"the {CONSTRAINT_REFUSAL} now: it waited {self.patience_s:g} s behind other compiles; retry "
                    f"later", status=503))
        for large, lane in enumerate(self._lanes):
            if large and len(self._abandoned) >= MAX_ABANDONED:
                while lane.queue:
                    self._settle(lane.queue.popleft(), GrammarError(
                        f"the {CONSTRAINT_REFUSAL} now: the server is still running {len(self._abandoned)} "
                        f"over-long compiles; retry later or send a smaller constraint", status=503))
            if lane.running is None and lane.queue:
                job = lane.running = lane.queue.popleft()
                job.started = self.clock()
                job.thread = threading.Thread(target=self._run, args=(job,), name="grammar-compile", daemon=True)
                job.thread.start()

    def _run(self, job: _Job) -> None:
        try:
            job.result = self._compile_or_error(job.spec)
        except Exception as exc:  # _compile raises GrammarError; anything else is a bug, answered as one
            log.error("grammar compile raised: %r", exc)
            job.result = GrammarError(f"internal error: {exc}")
        finally:
            job.done.set()

    def _compile_or_error(self, spec: StructuredOutput):
        try:
            return self._compile(spec)
        except GrammarError as exc:
            return exc

    def _warm_up(self) -> None:
        try:
            self._tokenizer_info()
        except Exception as exc:  # the first compile meets it again and answers it as that constraint's error
            log.debug("grammar tables not built at start-up: %r", exc)

    def _tokenizer_info(self):
        """xgrammar's tables of the tokenizer, built once (seconds for a large vocabulary)."""
        with self._build_lock:
            if self._info is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir, trust_remote_code=self.trust_remote_code)
                self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.eos_token_ids or None)
            return self._info

    def _xgrammar_compiler(self):
        """An xgrammar GrammarCompiler of this thread's own (microseconds to build; the lanes' compiles may run at
        once, and nothing here relies on one compiler being safe to share), with one thread: compiles are off the
        step loop already, and the step's own threads need the cores."""
        import xgrammar as xgr

        return xgr.GrammarCompiler(self._tokenizer_info(), max_threads=1, cache_enabled=False)

    def _compile(self, spec: StructuredOutput):
        """The CompiledGrammar of `spec`. Raises GrammarError with xgrammar's reason."""
        compiler = self._xgrammar_compiler()
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec.spec)))
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.spec)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its parser's message
            message = str(exc).strip().splitlines()
            reason = XGRAMMAR_LOG_PREFIX.sub("", message[-1]) if message else type(exc).__name__
            raise GrammarError(f"the {spec.kind} {CONSTRAINT_REFUSAL}: {reason[:MAX_ERROR_CHARS]}") from None
        raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def _answer(answers: list[tuple[str, CompiledGrammar | GrammarError]]) -> GrammarsCompiled:
    """GrammarsCompiled of (key, CompiledGrammar or GrammarError) pairs: the error's text or "", and the bytes."""
    errors = [str(value) if isinstance(value, GrammarError) else "" for _, value in answers]
    sizes = [0 if isinstance(value, GrammarError) else value.memory_size_bytes for _, value in answers]
    statuses = [value.status if isinstance(value, GrammarError) else 0 for _, value in answers]
    return GrammarsCompiled(keys=[key for key, _ in answers], errors=errors, sizes=sizes,
                            statuses=statuses if any(s == 503 for s in statuses) else [])


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (each a JSON string literal, which GBNF reads too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's position in its grammar.

    Once the grammar has ended (a stop token accepted), the only allowed tokens are the end-of-sequence ids: a step
    planned before the scheduler saw that end may still sample the request once more, and that token is dropped.

    With `starts_after` (StructuredOutput.starts_after: a reasoning model's end-of-thinking token), every token is
    free until that one has been sampled (`active` is False until then, and the row is not masked); the grammar
    governs the tokens after it.
    """

    def __init__(self, matcher, eos_token_ids: list[int], starts_after: int | None = None):
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.starts_after = starts_after
        self.active = starts_after is None

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it (nothing changes then)."""
        if not self.active:
            self.active = token == self.starts_after
            return True
        if self.matcher.is_terminated():
            return token in self.eos_token_ids
        return self.matcher.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (int32 [R, ceil(vocab / 32)], bit set =
        allowed)."""
        if self.matcher.is_terminated():
            bitmask[row].zero_()
            for token in self.eos_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


def _bit(position: int) -> int:
    """Bit `position` of an int32 word as a Python int that fits it (bit 31 is the sign)."""
    return (1 << position) - (1 << 32) * (position == 31)


class GrammarMasks:
    """Masks the logits of constrained rows before sampling: one bitmask filled on the host (every constrained row
    in one batched call), one copy, one masking kernel. A step without constrained rows never gets here.

    Args:
        vocab_size: the grammar's vocabulary (GrammarCompiler.vocab_size); logits columns past it are masked too.
        device: the logits' device.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.device = device
        self._words = -(-vocab_size // 32)
        self._host = torch.empty(0, self._words, dtype=torch.int32)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Set to -inf, in place, the logits each state's grammar forbids.

        Args:
            logits: float [S, vocab] (any float dtype), the step's sampling rows.
            rows: the rows of `logits` that are constrained; states: their grammar states, in the same order.
        """
        if len(self._host) < len(logits):
            size = max(len(logits), 2 * len(self._host), 8)
            self._host = torch.empty(size, self._words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        bitmask = self._host[:len(logits)]  # row i masks logits row i; rows not in `rows` are neither filled nor read
        if not any(s.matcher.is_terminated() for s in states):
            self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)
        else:
            for row, state in zip(rows, states):
                state.fill(bitmask, row)
        # The host buffer is refilled only after this step's tokens reached the host, so the copy is long done.
        mask = bitmask.to(self.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)
        if logits.shape[1] > self.vocab_size:  # padded output rows are no token at all
            logits[torch.tensor(rows, device=logits.device), self.vocab_size:] = float("-inf")
