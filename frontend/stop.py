"""Stop strings on streamed text: find them across token boundaries, hold back what may be the start of one."""

from __future__ import annotations


class StopStringMatcher:
    """Feeds text deltas, returns what is safe to emit.

    Text that could be the beginning of a stop string is held until it is clearly not one, so a stream never
    shows any part of a stop string (unless `include_stop` asks for the stop string itself in the output).

    Args:
        stops: the stop strings (non-empty).
        include_stop: emit the stop string that ended the output (vLLM's include_stop_str_in_output).
    """

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = stops
        self.include_stop = include_stop
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add a delta; returns the text to emit now. Sets `stopped` once a stop string is found."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buffer = self._held + text
        hits = [(buffer.find(stop), stop) for stop in self.stops]
        hits = [(index, stop) for index, stop in hits if index >= 0]
        if hits:
            index, stop = min(hits)
            self.stopped, self._held = True, ""
            return buffer[:index] + (stop if self.include_stop else "")
        keep = self._partial_match_length(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """At the end of the output: release held text (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
