"""`background: true` on POST /v1/responses: the response is stored and answered at once (status "queued"), then
runs in a task of its own, apart from the HTTP request (a client that goes away changes nothing); GET
/v1/responses/{id} shows it advance (in_progress) to its one terminal status: completed, incomplete, failed (with
OpenAI's `error` object) or cancelled (POST /v1/responses/{id}/cancel, `cancel` below). A drain fails what is still
in flight (frontend/lifecycle.py's drain ends every engine request), and the store's close() ends the rest.

An engine without room for it (its 503 with a Retry-After: the waiting queue full, an SLO refusal, a restart) does
not fail it: it waits in line, queued again, and is submitted anew when the engine says a retry gets in. That is
what `queued` means in OpenAI's API, and what vLLM does (its engine queues every request it is given); answering
503 at once instead would need the engine to acknowledge admission, which it never does before the first token.
"""

from __future__ import annotations

import asyncio
import logging

from shuttle.common.errors import GenerationError, InvalidRequestError
from shuttle.frontend.responses.api import ResponsesCall
from shuttle.frontend.responses.store import TERMINAL, ResponseStore, StoredResponse, ended

log = logging.getLogger("shuttle.frontend")


def start(call: ResponsesCall) -> dict:
    """Store `call`'s response as queued and start running it; the queued response object.

    Raises:
        GenerationError: the engine admits nothing now (503: draining, restarting), as a foreground request.
        InvalidRequestError: a sampling parameter out of range (checked before anything is stored).
    """
    state = call.state
    refusal = state.engine.admission_error()
    if refusal is not None:
        raise refusal
    call.generations = call.build()
    queued = call.response([], None, status="queued")
    entry = state.responses.put(queued, call.input_items, call.input_size, call.body_bytes)
    entry.task = asyncio.create_task(_run(call, entry), name=f"background-{call.request_id}")
    return queued


async def _run(call: ResponsesCall, entry: StoredResponse) -> None:
    try:
        while True:
            entry.settle(call.response([], None))  # in progress: its request is with the scheduler
            try:
                entry.settle(await call.collect())
                return
            except GenerationError as exc:
                if exc.status != 503 or exc.retry_after is None:  # None: the server is going away
                    raise
                # the engine has no room now (a full waiting queue, an SLO refusal, a restart): the response waits
                # in line, queued, as OpenAI's do, and asks again when the engine says a retry gets in; its output
                # was never shown, so it starts over
                entry.settle(call.response([], None, status="queued"))
                await asyncio.sleep(exc.retry_after or 1.0)  # 0: unknown, a second (as Retry-After says)
                call.generations = call.build()
    except asyncio.CancelledError:
        entry.end()  # as whoever cancelled it said (cancel: cancelled; a shutdown: failed)
        raise
    except GenerationError as exc:
        code = "invalid_prompt" if exc.status == 400 else "server_error"
        entry.settle(ended(entry.response, "failed", {"code": code, "message": str(exc)}))
    except Exception:
        log.exception("background response %s failed", call.request_id)
        entry.settle(ended(entry.response, "failed", {"code": "server_error", "message": "internal server error"}))
    finally:
        entry.task = None


async def cancel(store: ResponseStore, response_id: str) -> dict:
    """POST /v1/responses/{id}/cancel: a background response still queued or in progress ends `cancelled` (its
    engine request aborted); one already cancelled is answered as it is (cancelling is idempotent, as OpenAI's).

    Raises:
        ResponseNotFoundError: not stored.
        InvalidRequestError: not a background response, or one that already ended otherwise.
    """
    entry = store.get(response_id)
    if not entry.response["background"]:
        raise InvalidRequestError("Cannot cancel a synchronous response.")
    if entry.status in TERMINAL and entry.status != "cancelled":
        raise InvalidRequestError(f"Cannot cancel a response that has already ended (its status is "
                                  f"'{entry.status}').")
    task = entry.task
    if task is not None:
        entry.ending = ("cancelled", None)
        task.cancel()
        await asyncio.wait([task])
    entry.end()  # a task cancelled before it ran never settled
    return entry.response
