"""The Responses API's memory: a bounded in-memory store of response objects, for previous_response_id,
GET /v1/responses/{id} and background responses (frontend/responses/background.py).

Bounded by count (`--responses-store-max-entries`), by age (`--responses-store-max-age`, seconds since the
response ended: a background response ages from its end, and one still running is never evicted by age, since its
client cannot have read it yet) and by the bytes of the request bodies it holds (MAX_BYTES; a response's output is
bounded by the context length): beyond the count or the bytes the oldest goes first, whatever its status (a
background response evicted while it runs is cancelled, since nothing could read its result). Every operation is
O(1) amortized (plus a step over each background response still running) and never waits, so the store is used from
the event loop directly.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from shuttle.common.errors import GenerationError, InvalidRequestError

MAX_BYTES = 512 * 2**20  # request bodies held at most (a body is at most 4 MiB: a count bound alone allows 4 GiB)
TERMINAL = ("completed", "incomplete", "failed", "cancelled")  # a response in one of these never changes again
# the output items a later turn's input takes (what previous_response_id continues); reasoning is left out, as vLLM
CONVERSATION_ITEMS = ("message", "function_call")


class ResponseNotFoundError(GenerationError):
    """A response id the store does not hold (never stored, deleted, or evicted): HTTP 404 naming it.

    Attributes:
        param: the request field that named it (previous_response_id), None for a path's id.
    """

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(404, f"Response with id '{response_id}' not found.", param=param)


@dataclass
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object GET answers (replaced, never mutated, as a background response advances).
        input_items: the conversation up to this response, as Responses input items (dicts): the previous
            response's conversation, then this request's input.
        stored_at: the store clock's seconds when stored, or when it ended for one stored before its end (a
            background response): its age counts from here.
        size: about the bytes of the conversation (the request bodies that made it): how much work continuing it is.
        body_bytes: the bytes of this response's own request body (what the store counts against MAX_BYTES; the
            conversation's earlier items are shared with the responses it continues).
        task: a background response's run while it runs, else None.
        ending: (status, error) that whoever cancels `task` sets first: what the response ends as.
        on_end: called once with this entry when a response stored before its end reaches a terminal status.
    """

    response: dict
    input_items: list[dict]
    stored_at: float
    size: int = 0
    body_bytes: int = 0
    task: asyncio.Task | None = None
    ending: tuple[str, dict | None] = ("cancelled", None)
    on_end: Callable[[StoredResponse], None] | None = None

    @property
    def status(self) -> str:
        return self.response["status"]

    def settle(self, response: dict) -> None:
        """Take `response` unless this one has already ended: a response has exactly one terminal outcome."""
        if self.status not in TERMINAL:
            self.response = response
            if response["status"] in TERMINAL and self.on_end is not None:
                self.on_end(self)

    def end(self) -> None:
        """Settle as `ending` says (the run was cancelled, or never started)."""
        status, error = self.ending
        self.settle(ended(self.response, status, error))

    def conversation(self) -> list[dict]:
        """The input items that continue this response: its conversation, then its output's messages and calls."""
        return [*self.input_items, *(item for item in self.response["output"]
                                     if item.get("type") in CONVERSATION_ITEMS)]


def ended(response: dict, status: str, error: dict | None = None) -> dict:
    """A copy of `response` that ended as `status` (with OpenAI's `error` object {"code", "message"} if failed)."""
    return {**response, "status": status, "error": error}


class ResponseStore:
    """The stored responses, oldest first.

    Args:
        max_entries: most responses kept (0: none; `enabled` is then False).
        max_age: seconds a response is kept after it ended (0: no age limit); one still running is kept.
        clock: seconds, monotonic (tests pass a fake one).
        max_bytes: request body bytes held at most (the newest response is kept whatever its size).

    Attributes:
        body_bytes: the request body bytes held now.
    """

    def __init__(self, max_entries: int, max_age: float, clock: Callable[[], float] = time.monotonic,
                 max_bytes: int = MAX_BYTES):
        self.max_entries = max_entries
        self.max_age = max_age
        self.clock = clock
        self.max_bytes = max_bytes
        self.body_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict, input_items: list[dict], size: int = 0, body_bytes: int = 0) -> StoredResponse:
        """Store `response` (under its "id") with the conversation that led to it (`size`, `body_bytes`: see
        StoredResponse); the oldest go beyond the bounds.

        Raises:
            InvalidRequestError: the store keeps nothing (`enabled` is False).
        """
        if not self.enabled:
            raise InvalidRequestError("this server stores no responses (--responses-store-max-entries 0)",
                                      param="store")
        entry = StoredResponse(response, input_items, self.clock(), size, body_bytes)
        if entry.status not in TERMINAL:
            entry.on_end = self._ended
        self._entries[response["id"]] = entry
        self.body_bytes += body_bytes
        self._expire()
        while len(self._entries) > self.max_entries or (self.body_bytes > self.max_bytes and len(self._entries) > 1):
            self._evict(next(iter(self._entries)))
        return entry

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response `response_id`.

        Raises:
            ResponseNotFoundError: not stored (never, deleted, or evicted); `param` names the field that asked.
        """
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(response_id, param)
        return entry

    def previous(self, response_id: str) -> StoredResponse:
        """The stored response previous_response_id names, to continue (its `conversation()`).

        Raises:
            ResponseNotFoundError: not stored (param "previous_response_id").
            InvalidRequestError: it is a background response that has not ended yet.
        """
        entry = self.get(response_id, "previous_response_id")
        if entry.status not in TERMINAL:
            raise InvalidRequestError(f"Previous response with id '{response_id}' is still {entry.status}: "
                                      f"continue it once it has ended", param="previous_response_id")
        return entry

    def delete(self, response_id: str) -> None:
        """Forget response `response_id`; one still running is cancelled.

        Raises:
            ResponseNotFoundError: not stored.
        """
        self.get(response_id)
        self._evict(response_id)

    async def close(self) -> None:
        """End every background response still running (the server is going away): each fails with a 503 message
        and its engine request is aborted."""
        running = [entry for entry in self._entries.values() if entry.task is not None and not entry.task.done()]
        for entry in running:
            entry.ending = ("failed", {"code": "server_error",
                                       "message": "the server shut down before this response finished"})
            assert entry.task is not None  # filtered above
            entry.task.cancel()
        if running:
            await asyncio.wait([entry.task for entry in running if entry.task is not None])
        for entry in running:
            entry.end()

    def _ended(self, entry: StoredResponse) -> None:
        """A response stored before its end has ended: its age starts now, and it is the newest."""
        entry.stored_at = self.clock()
        response_id = entry.response["id"]
        if self._entries.get(response_id) is entry:
            self._entries.move_to_end(response_id)

    def _expire(self) -> None:
        if self.max_age <= 0:
            return
        # ended entries are in the order of their stored_at (each goes to the end as it ends; the clock is
        # monotonic), so the expired ones are at the front, between running ones, which age does not evict
        oldest = self.clock() - self.max_age
        expired = []
        for response_id, entry in self._entries.items():
            if entry.status not in TERMINAL:
                continue
            if entry.stored_at > oldest:
                break
            expired.append(response_id)
        for response_id in expired:
            self._evict(response_id)

    def _evict(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        self.body_bytes -= entry.body_bytes
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()  # nothing could read its result: its engine request is aborted
