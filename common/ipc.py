"""The only module that touches raw ZeroMQ sockets: typed channels that hold their encoder and decoder.

Every payload is msgspec msgpack of a declared Struct; no generic Python object serialization. A ROUTER prefixes each message with the peer's
identity frame, which is how the scheduler knows which frontend a request's outputs go back to.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()
CURVE_ENV = "SHUTTLE_CURVE_KEYS"


@dataclass(frozen=True)
class CurveKeys:
    """One launch's ZeroMQ CURVE keys (Z85 text): the binding side proves itself with the server pair, every
    connecting side with the client pair, and a ZAP handler in each binding process admits only that client
    key. A process without both keys can neither connect nor be connected to, even on loopback."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @staticmethod
    def generate() -> "CurveKeys":
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return CurveKeys(server_public.decode(), server_secret.decode(), client_public.decode(),
                         client_secret.decode())

    def to_env(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_env() -> "CurveKeys":
        """Raises RuntimeError when the launcher did not pass keys (SHUTTLE_CURVE_KEYS)."""
        text = os.environ.get(CURVE_ENV)
        if not text:
            raise RuntimeError(f"tcp transport needs CURVE keys in ${CURVE_ENV} (set by the launcher)")
        return CurveKeys(**json.loads(text))


_authenticators: dict[int, Any] = {}
_auth_lock = threading.Lock()


class _OnlyClientKey:
    def __init__(self, client_public: str):
        self.client_public = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def _secure(ctx: zmq.Context, sock: zmq.Socket, bind: bool, keys: CurveKeys) -> None:
    if bind:
        with _auth_lock:  # one ZAP handler per context, started with the first CURVE server socket
            if id(ctx) not in _authenticators:
                from zmq.auth.thread import ThreadAuthenticator
                if isinstance(ctx, zmq.asyncio.Context):
                    raise RuntimeError("CURVE server sockets need a synchronous context (the ZAP handler's thread)")
                auth = ThreadAuthenticator(ctx)
                auth.start()
                auth.configure_curve_callback("shuttle", _OnlyClientKey(keys.client_public))
                _authenticators[id(ctx)] = auth
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret.encode()
        sock.curve_publickey = keys.server_public.encode()
        sock.zap_domain = b"shuttle"
    else:
        sock.curve_serverkey = keys.server_public.encode()
        sock.curve_publickey = keys.client_public.encode()
        sock.curve_secretkey = keys.client_secret.encode()


def _open(ctx: zmq.Context, kind: int, endpoint: str, bind: bool, curve: bool = False) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: the scheduler's flow control is its own (step budgets), never a dropped message.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if curve and endpoint.startswith("tcp://"):
        _secure(ctx, sock, bind, CurveKeys.from_env())
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
        curve: authenticate a tcp:// endpoint with the launch's CURVE keys (see CurveKeys); ipc:// ignores it.
    """

    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool, recv_type: Any = None,
                 curve: bool = False):
        self.socket = _open(ctx, kind, endpoint, bind, curve)
        self._decoder = msgspec.msgpack.Decoder(recv_type) if recv_type is not None else None

    def send(self, msg: msgspec.Struct, identity: bytes | None = None) -> None:
        """Send one message; a ROUTER must name the peer's `identity`."""
        payload = _ENCODER.encode(msg)
        if identity is None:
            self.socket.send(payload, copy=False)
        else:
            self.socket.send_multipart((identity, payload), copy=False)

    def try_send(self, msg: msgspec.Struct) -> bool:
        """Send without blocking; False when no peer can take it now (e.g. none connected to a PUSH)."""
        try:
            self.socket.send(_ENCODER.encode(msg), zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

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


class MalformedMessage(Exception):
    """A peer sent something that is not one well-formed message; `identity` is who sent it, `payload` the one
    payload frame when there was exactly one (so the caller can still read what it can of it)."""

    def __init__(self, identity: bytes, reason: str, payload: bytes | None = None):
        super().__init__(reason)
        self.identity = identity
        self.payload = payload


class AsyncChannel(Generic[T]):
    """The asyncio twin of Channel, for the frontend's event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, kind: int, endpoint: str, *, bind: bool, recv_type: Any = None,
                 curve: bool = False):
        self.socket = _open(ctx, kind, endpoint, bind, curve)
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
        """(peer identity, message) from a ROUTER.

        Raises:
            MalformedMessage: not exactly one payload frame, or a payload that does not decode; carries the
                peer's identity so the caller can answer it.
        """
        frames = await self.socket.recv_multipart(copy=False)
        identity = frames[0].bytes
        if len(frames) != 2:
            raise MalformedMessage(identity, f"expected 1 payload frame, got {len(frames) - 1}")
        try:
            return identity, self._decoder.decode(frames[1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessage(identity, str(exc), frames[1].bytes) from None

    def close(self) -> None:
        self.socket.close(linger=0)
