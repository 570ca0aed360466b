"""Constrained requests wait here, outside the queue, until the worker has compiled their grammar.

A request's grammar is compiled by the worker off its step loop (worker/grammar.py); until it is ready the request
is not in the waiting queue, so it holds back neither the batch nor the requests queued behind it. The gate asks the
worker once per constraint (requests with equal constraints wait on one compile), remembers the last
GRAMMAR_CACHE_ENTRIES constraints that compiled so that their next requests go straight to the queue, and hands
back which requests may be queued and which must fail (400, xgrammar's reason) when an answer arrives.
"""

from __future__ import annotations

from collections import OrderedDict

from common.messages import GRAMMAR_CACHE_ENTRIES, GrammarsCompiled
from common.sampling import StructuredOutput
from scheduler.request import Request


class GrammarGate:
    """Holds constrained requests until their grammar compiled. Pure bookkeeping: the loop sends `take_requests()`
    to the worker and feeds its answers to `answered()`."""

    def __init__(self, cache_entries: int = GRAMMAR_CACHE_ENTRIES):
        self.cache_entries = cache_entries
        self._ready: OrderedDict[str, None] = OrderedDict()  # keys known compiled, least recently used first
        self._held: dict[str, list[Request]] = {}  # key -> requests waiting for it, in arrival order
        self._asked: set[str] = set()  # keys sent to the worker and not answered yet
        self._to_ask: dict[str, StructuredOutput] = {}
        self._num_held = 0  # requests in _held (the queue bound counts them on every arrival)

    @property
    def num_held(self) -> int:
        return self._num_held

    def hold(self, request: Request) -> bool:
        """True when `request` must wait for its grammar (it is held here); False when it may be queued now."""
        spec = request.sampling.structured
        if spec is None:
            return False
        key = spec.key
        if key in self._ready:
            self._ready.move_to_end(key)
            return False
        self._held.setdefault(key, []).append(request)
        self._num_held += 1
        if key not in self._asked:
            self._asked.add(key)
            self._to_ask[key] = spec
        return True

    def release(self, request: Request) -> bool:
        """Forget a held request (aborted, timed out); False when it was not held."""
        key = request.sampling.structured.key if request.sampling.structured is not None else None
        waiting = self._held.get(key)
        if not waiting or request not in waiting:
            return False
        waiting.remove(request)
        self._num_held -= 1
        if not waiting:
            del self._held[key]
        return True

    def take_requests(self) -> list[StructuredOutput]:
        """The constraints to send to the worker now (each once until it answers)."""
        specs = list(self._to_ask.values())
        self._to_ask.clear()
        return specs

    def answered(self, message: GrammarsCompiled) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests that may be queued now, (request, error) pairs that must fail) for the worker's answers."""
        ready, failed = [], []
        for key, error in zip(message.keys, message.errors):
            self._asked.discard(key)
            requests = self._held.pop(key, [])
            self._num_held -= len(requests)
            if error:
                failed.extend((r, error) for r in requests)
                continue
            self._ready[key] = None
            self._ready.move_to_end(key)
            while len(self._ready) > self.cache_entries:
                self._ready.popitem(last=False)
            ready.extend(requests)
        return ready, failed
