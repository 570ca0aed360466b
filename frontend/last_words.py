"""Last words: when the launcher replaces this frontend (it stopped heartbeating: a wedged event loop, a stopped
process), every open stream gets its terminal error before the process goes, instead of a connection cut with no
answer.

The launcher sends LAST_WORDS_SIGNAL (SIGUSR2; then SIGCONT, in case the process was stopped), waits LAST_WORDS_S
(common/process.py), then SIGKILLs. The
handler is a plain `signal.signal` one, not the event loop's: Python runs it in the main thread at the next bytecode,
even while the loop itself is stuck in Python code. It cannot use the loop, so it writes each stream's terminal
frames straight to the stream's socket, framed as that response is on the wire (an HTTP/1.1 chunk of an SSE body,
an unmasked WebSocket text frame then a close frame with 1012, "service restart"), and exits with EXIT_REPLACED.

Best effort, by construction: a stream whose transport still holds unsent bytes is skipped (writing past them would
garble its stream), as is one whose socket cannot take the bytes at once (a client that stopped reading); the
handler never blocks. A loop stuck in C code that holds the GIL does not run the handler at all, and SIGKILL follows.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
from typing import Callable

from shuttle.common.process import LAST_WORDS_SIGNAL

EXIT_REPLACED = 4  # the frontend's exit status after its last words (the launcher restarts it anyway)
CLOSE_SERVICE_RESTART = 1012  # RFC 6455 close code, IANA registry: "Service Restart"
MESSAGE = "the server's frontend is restarting; retry shortly"

# id -> (transport, () -> the bytes to write, already framed for the wire)
_open: dict[int, tuple[asyncio.Transport | None, Callable[[], bytes]]] = {}


def register(transport: asyncio.Transport | None, last_bytes: Callable[[], bytes]) -> int:
    """Remember an open stream until `unregister`; returns its token. `last_bytes` is called in the signal handler:
    it must not await, lock or allocate much."""
    token = id(last_bytes)
    _open[token] = (transport, last_bytes)
    return token


def unregister(token: int) -> None:
    _open.pop(token, None)


def sse_chunk(data: bytes, chunked: bool) -> bytes:
    """`data` as the rest of an SSE body: one HTTP/1.1 chunk and the last chunk when chunked, else as it is."""
    if not chunked:
        return data
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)


def websocket_frames(texts: list[str], close_code: int = CLOSE_SERVICE_RESTART, reason: str = "") -> bytes:
    """Unmasked server-to-client WebSocket frames (RFC 6455, section 5.2): each text in a final text frame (RSV1
    clear: uncompressed, which permessage-deflate allows), then a close frame with `close_code`."""
    frames = b"".join(_frame(0x1, text.encode()) for text in texts)
    return frames + _frame(0x8, struct.pack("!H", close_code) + reason.encode()[:120])


def _frame(opcode: int, payload: bytes) -> bytes:
    length = len(payload)
    if length < 126:
        head = struct.pack("!BB", 0x80 | opcode, length)
    elif length < 2**16:
        head = struct.pack("!BBH", 0x80 | opcode, 126, length)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, length)
    return head + payload


def websocket_error(client_id: str | int) -> str:
    """The WebSocket error frame (as frontend/transports/websocket.py writes them) of a stream ended by a restart."""
    return json.dumps({"type": "error", "id": client_id, "should_retry": True,
                       "error": {"message": MESSAGE, "type": "service_unavailable", "param": None, "code": 503}})


def install() -> None:
    """Answer LAST_WORDS_SIGNAL with the last words and an exit (the frontend's main thread, at start-up)."""
    signal.signal(LAST_WORDS_SIGNAL, _last_words)


def _last_words(signum, frame) -> None:
    written = skipped = 0
    for transport, last_bytes in list(_open.values()):
        try:
            if transport is None or transport.is_closing() or transport.get_write_buffer_size():
                skipped += 1
                continue
            data = last_bytes()
            if os.write(transport.get_extra_info("socket").fileno(), data) == len(data):
                written += 1
            else:
                skipped += 1
        except Exception:  # never let one stream keep the others from their answer
            skipped += 1
    try:  # straight to stderr: logging takes locks the interrupted code may hold
        os.write(2, b"frontend replaced by the launcher: ended %d open stream(s) with an error, %d could not be "
                    b"written\n" % (written, skipped))
    finally:
        os._exit(EXIT_REPLACED)
