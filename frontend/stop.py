"""Stop strings on streamed text: find them across token boundaries, hold back what may be the start of one."""

from __future__ import annotations

import math


class StopStringMatcher:
    """Feeds text deltas, returns what is safe to emit.

    Text that could be the beginning of a stop string is held until it is clearly not one, so a stream never
    shows any part of a stop string (unless `include_stop` asks for the stop string itself in the output).
    Positions count characters of the whole text fed so far.

    min_tokens: text before `protect(position)` can be no part of a stop string (vLLM's rule, no stop condition
    of any kind within the first min_tokens tokens, made strict: a stop string that starts in that text and ends
    after it does not count either, so the text of the first min_tokens tokens is always output whole). Until
    `protect` is called with a position, all text is protected.

    Args:
        stops: the stop strings (non-empty).
        include_stop: emit the stop string that ended the output (vLLM's include_stop_str_in_output).
        protected: whether text is protected until `protect` is called (a request with min_tokens > 0).
    """

    def __init__(self, stops: list[str], include_stop: bool = False, protected: bool = False):
        self.stops = stops
        self.include_stop = include_stop
        self._held = ""
        self._search_from: float = math.inf if protected else 0
        self.released = 0  # characters emitted so far
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output (Anthropic's stop_sequence)

    def protect(self, position: int) -> None:
        """Stop strings may start at `position` or later (the length of the first min_tokens tokens' text)."""
        self._search_from = position

    def feed(self, text: str) -> str:
        """Add a delta; returns the text to emit now. Sets `stopped` once a stop string is found."""
        if self.stopped:
            return ""
        return self._scan(self._held + text, final=False)

    def flush(self) -> str:
        """At the end of the output: release held text, up to a stop string in it (one found while a longer one
        that starts earlier could still complete)."""
        held, self._held = self._held, ""
        return "" if self.stopped else self._scan(held, final=True)

    def _scan(self, buffer: str, final: bool) -> str:
        start = self.released  # where buffer[0] is in the whole text
        first = int(min(max(self._search_from - start, 0), len(buffer)))  # earliest index a stop string may start
        hits = [(buffer.find(stop, first), stop) for stop in self.stops]
        hit = min(((index, stop) for index, stop in hits if index >= 0), default=None)
        # the earliest start of text that may still become a stop string (a proper prefix of one, to the end)
        pending = len(buffer) if final else len(buffer) - self._partial_match_length(buffer[first:])
        if hit is not None and hit[0] <= pending:
            index, stop = hit
            self.stopped, self._held, self.matched = True, "", stop
            return self._emit(buffer[:index] + (stop if self.include_stop else ""))
        # nothing found, or a stop string found after the start of one that may yet complete: the earliest start
        # wins (whatever the deltas), so that is decided when more text comes
        self._held = buffer[pending:]
        return self._emit(buffer[:pending])

    def _emit(self, text: str) -> str:
        self.released += len(text)
        return text

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
