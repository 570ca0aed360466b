"""Every frame a WebSocket client sends must be masked; a server must close the connection on one that is not
(RFC 6455, section 5.1). aiohttp's frame reader serves its clients too, where frames come unmasked, so it does not
check: `MaskedFramesOnly` sits in front of it and follows the frame boundaries in the byte stream (each header's
mask bit and payload length; payload bytes are skipped, never copied or unmasked here).
"""

from __future__ import annotations

import struct
from typing import Callable

from aiohttp import WSCloseCode

MASK_BIT = 0x80
REASON = b"client frames must be masked"
# A close frame (FIN, opcode 8; a server's frames are unmasked): status 1002 (protocol error), then the reason
CLOSE_FRAME = bytes([0x88, 2 + len(REASON)]) + struct.pack(">H", WSCloseCode.PROTOCOL_ERROR) + REASON


class MaskedFramesOnly:
    """aiohttp's WebSocketReader (its `feed_data`/`feed_eof` interface) behind a mask check.

    The bytes before an unmasked frame still reach the reader (the frames the client sent properly are handled);
    then `on_unmasked(CLOSE_FRAME)` is called once, to send the close frame and close the connection, and nothing
    more is passed on.
    """

    def __init__(self, reader, on_unmasked: Callable[[bytes], None]):
        self._reader = reader
        self._on_unmasked = on_unmasked
        self._head = bytearray()  # the header of the frame being read, so far (at most 14 bytes)
        self._payload_left = 0  # bytes of the current frame's payload not yet seen
        self._refused = False

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if self._refused:
            return True, b""
        unmasked_at = self._first_unmasked(data)
        if unmasked_at is None:
            return self._reader.feed_data(data)
        self._refused = True
        if unmasked_at:
            self._reader.feed_data(data[:unmasked_at])
        self._on_unmasked(CLOSE_FRAME)
        return True, b""

    def feed_eof(self) -> None:
        self._reader.feed_eof()

    def _first_unmasked(self, data: bytes) -> int | None:
        """Where in `data` a frame without the mask bit starts (0 when it started in an earlier chunk), or None."""
        pos, end = 0, len(data)
        while pos < end:
            if self._payload_left:
                step = min(self._payload_left, end - pos)
                self._payload_left -= step
                pos += step
                continue
            frame_start = max(pos - len(self._head), 0)
            take = min(self._header_size() - len(self._head), end - pos)
            self._head += data[pos:pos + take]
            pos += take
            if len(self._head) >= 2 and not self._head[1] & MASK_BIT:
                return frame_start
            if len(self._head) == self._header_size():
                self._payload_left = self._payload_length()
                self._head.clear()
        return None

    def _header_size(self) -> int:
        """2 bytes until the length byte is known; then those, the extended length and the 4-byte mask key."""
        if len(self._head) < 2:
            return 2
        return 2 + {126: 2, 127: 8}.get(self._head[1] & 0x7F, 0) + 4

    def _payload_length(self) -> int:
        length = self._head[1] & 0x7F
        if length == 126:
            return struct.unpack_from(">H", self._head, 2)[0]
        if length == 127:
            return struct.unpack_from(">Q", self._head, 2)[0]
        return length
