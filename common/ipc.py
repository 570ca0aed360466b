"""The only module that touches raw ZeroMQ sockets: typed channels that hold their encoder and decoder.

Every payload is msgspec msgpack of a declared Struct; no generic Python object serialization. A ROUTER prefixes each message with the peer's
identity frame, which is how the scheduler knows which frontend a request's outputs go back to.
"""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()


def _open(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: the scheduler's flow control is its own (step budgets), never a dropped message.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)
    else:
        sock.connect(endpoint)
    return sock


class Channel(Generic[T]):
    """A synchronous socket that sends any wire Struct and decodes what it receives as `recv_type`.

    Args:
        kind: zmq.PUSH, zmq.PULL, zmq.ROUTER, zmq.DEALER.
        recv_type: the tagged union this end receives (None for a send-only socket).
    """

    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool, recv_type: Any = None):
        self.socket = _open(ctx, kind, endpoint, bind)
        self._decoder = msgspec.msgpack.Decoder(recv_type) if recv_type is not None else None

    def send(self, msg: msgspec.Struct, identity: bytes | None = None) -> None:
        """Send one message; a ROUTER must name the peer's `identity`."""
        payload = _ENCODER.encode(msg)
        if identity is None:
            self.socket.send(payload, copy=False)
        else:
            self.socket.send_multipart((identity, payload), copy=False)

    def recv(self) -> T:
        """Block until one message arrives (DEALER/PULL)."""
        return self._decoder.decode(self.socket.recv(copy=False).buffer)

    def recv_from(self) -> tuple[bytes, T]:
        """Block until one message arrives on a ROUTER; returns (peer identity, message)."""
        identity, payload = self.socket.recv_multipart(copy=False)
        return identity.bytes, self._decoder.decode(payload.buffer)

    def poll(self, timeout_ms: int) -> bool:
        """True when a message is waiting (waits up to timeout_ms milliseconds)."""
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def close(self) -> None:
        self.socket.close(linger=0)


class AsyncChannel(Generic[T]):
    """The asyncio twin of Channel, for the frontend's event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, kind: int, endpoint: str, *, bind: bool, recv_type: Any = None):
        self.socket = _open(ctx, kind, endpoint, bind)
        self._decoder = msgspec.msgpack.Decoder(recv_type) if recv_type is not None else None

    async def send(self, msg: msgspec.Struct, identity: bytes | None = None) -> None:
        payload = _ENCODER.encode(msg)
        if identity is None:
            await self.socket.send(payload, copy=False)
        else:
            await self.socket.send_multipart((identity, payload), copy=False)

    async def recv(self) -> T:
        frame = await self.socket.recv(copy=False)
        return self._decoder.decode(frame.buffer)

    async def recv_from(self) -> tuple[bytes, T]:
        identity, payload = await self.socket.recv_multipart(copy=False)
        return identity.bytes, self._decoder.decode(payload.buffer)

    def close(self) -> None:
        self.socket.close(linger=0)
