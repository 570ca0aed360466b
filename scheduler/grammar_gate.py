"""Constrained requests wait here, outside the queue, until the worker has compiled their grammar.

A request's grammar is compiled by the worker off its step loop (worker/grammar.py); until it is ready the request
is not in the waiting queue, so it holds back neither the batch nor the requests queued behind it. The gate asks the
worker once per constraint (requests with equal constraints wait on one compile) and hands back which requests may
be queued and which must fail (400, xgrammar's reason) when an answer arrives.

The gate decides which compiled grammars the worker keeps: the worker drops one only when told to (CompileGrammars'
`evict`). A grammar is pinned while any request that passed the gate with it is queued or running, so a request
never reaches the step with its grammar gone (the worker would compile it there, freezing every stream for the
compile). Unpinned grammars stay for their next requests, least recently used first out, within
GRAMMAR_CACHE_ENTRIES and GRAMMAR_CACHE_BYTES (their sizes as the worker reports them).
"""

from __future__ import annotations

from collections import OrderedDict

from shuttle.common.messages import GRAMMAR_CACHE_BYTES, GRAMMAR_CACHE_ENTRIES, GrammarsCompiled
from shuttle.common.sampling import StructuredOutput
from shuttle.scheduler.request import Request


class GrammarGate:
    """Holds constrained requests until their grammar compiled, and keeps the book of what the worker holds. Pure
    bookkeeping: the loop sends `take_requests()` and `take_evictions()` to the worker (one CompileGrammars, the
    evictions first) and feeds its answers to `answered()`; the scheduler calls `done()` when a request ends.

    Args:
        cache_entries, cache_bytes: bounds on the unpinned compiled grammars kept in the worker.
    """

    def __init__(self, cache_entries: int = GRAMMAR_CACHE_ENTRIES, cache_bytes: int = GRAMMAR_CACHE_BYTES):
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self._ready: OrderedDict[str, int] = OrderedDict()  # keys compiled in the worker -> bytes, LRU first
        self._ready_bytes = 0
        self._pins: dict[str, int] = {}  # key -> requests past the gate with it, not ended
        self._passed: dict[str, str] = {}  # request id -> its key, for the requests counted in _pins
        self._held: dict[str, list[Request]] = {}  # key -> requests waiting for it, in arrival order
        self._asked: set[str] = set()  # keys sent to the worker and not answered yet
        self._to_ask: dict[str, StructuredOutput] = {}
        self._to_evict: list[str] = []
        self._num_held = 0  # requests in _held (the queue bound counts them on every arrival)

    @property
    def num_held(self) -> int:
        return self._num_held

    @property
    def resident(self) -> dict[str, int]:
        """The compiled grammars the worker holds by the gate's book: key -> bytes (evictions not yet sent are
        gone already)."""
        return dict(self._ready)

    def pins(self, key: str) -> int:
        return self._pins.get(key, 0)

    def hold(self, request: Request) -> bool:
        """True when `request` must wait for its grammar (it is held here); False when it may be queued now."""
        spec = request.sampling.structured
        if spec is None:
            return False
        key = spec.key
        if key in self._ready:
            self._ready.move_to_end(key)
            self._pin(request, key)
            return False
        self._held.setdefault(key, []).append(request)
        self._num_held += 1
        if key not in self._asked:
            self._asked.add(key)
            self._to_ask[key] = spec
        return True

    def release(self, request: Request) -> bool:
        """Forget a held request (aborted, timed out); False when it was not held."""
        if request.sampling.structured is None:
            return False  # never held: only a constrained request waits for its grammar
        key = request.sampling.structured.key
        waiting = self._held.get(key)
        if not waiting or request not in waiting:
            return False
        waiting.remove(request)
        self._num_held -= 1
        if not waiting:
            del self._held[key]
        return True

    def done(self, request: Request) -> None:
        """`request` ended (finished, aborted, failed; released first if it was held): past the gate, its grammar's
        pin goes, and an unpinned grammar may be evicted."""
        key = self._passed.pop(request.request_id, None)
        if key is None:
            return
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]
            self._trim()

    def take_requests(self) -> list[StructuredOutput]:
        """The constraints to send to the worker now (each once until it answers)."""
        specs = list(self._to_ask.values())
        self._to_ask.clear()
        return specs

    def take_evictions(self) -> list[str]:
        """The compiled grammars the worker must drop, to send with (before) the next compiles."""
        evict, self._to_evict = self._to_evict, []
        return evict

    def answered(self, message: GrammarsCompiled) -> tuple[list[Request], list[tuple[Request, str, int]]]:
        """(requests that may be queued now, (request, error, HTTP status) for those that must fail) for the
        worker's answers."""
        ready: list[Request] = []
        failed: list[tuple[Request, str, int]] = []
        sizes = message.sizes or [0] * len(message.keys)
        statuses = message.statuses or [400] * len(message.keys)
        for key, error, size, status in zip(message.keys, message.errors, sizes, statuses):
            self._asked.discard(key)
            requests = self._held.pop(key, [])
            self._num_held -= len(requests)
            if error:
                failed.extend((r, error, status or 400) for r in requests)
                continue
            if key in self._to_evict:  # asked again before its eviction went out: it stays
                self._to_evict.remove(key)
            self._ready_bytes += size - self._ready.get(key, 0)
            self._ready[key] = size
            self._ready.move_to_end(key)
            requests = [r for r in requests if r.is_live]
            for request in requests:
                self._pin(request, key)
            ready.extend(requests)
        self._trim()
        return ready, failed

    def _pin(self, request: Request, key: str) -> None:
        self._passed[request.request_id] = key
        self._pins[key] = self._pins.get(key, 0) + 1

    def _trim(self) -> None:
        """Evict unpinned grammars, least recently used first, while over either bound."""
        if len(self._ready) <= self.cache_entries and self._ready_bytes <= self.cache_bytes:
            return
        for key in list(self._ready):
            if len(self._ready) <= self.cache_entries and self._ready_bytes <= self.cache_bytes:
                return
            if key not in self._pins:
                self._ready_bytes -= self._ready.pop(key)
                self._to_evict.append(key)
