"""The only module that touches raw ZeroMQ sockets: typed channels that hold their encoder and decoder.

Every payload is msgspec msgpack of a declared Struct; no generic Python object serialization. A ROUTER prefixes each
message with the peer's identity frame, which is how the scheduler knows which frontend a request's outputs go back to.

No bytes a peer sends end a reader: a message that is not one well-formed message of the socket's type
(any frame count, any decoding failure, too deep) is counted in the channel's `faults`, warned about at most once
per peer per minute (common/wire_guard.py), and `recv()` returns None for it while `recv_from()` (a ROUTER, which
can answer) raises MalformedMessage. A socket that anyone can reach also bounds its frames' size (zmq.MAXMSGSIZE:
libzmq drops the connection of a peer that announces a larger frame, before buffering it) and its nesting depth.
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

from shuttle.common.wire_guard import FaultLog, GuardedDecoder, Malformed

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()
CURVE_ENV = "SHUTTLE_CURVE_KEYS"
PEER_PING_INTERVAL_MS = 1000  # ZeroMQ's heartbeat on a connection with a peer_timeout (AsyncChannel)


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


def _open(ctx: zmq.Context, kind: int, endpoint: str, bind: bool, curve: bool = False,
          max_message_bytes: int = 0, peer_timeout: float = 0.0) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if peer_timeout > 0:  # options that shape a connection must precede connect()
        # ZeroMQ's own heartbeat (ZMTP PING/PONG, libzmq >= 4.2): the peer's I/O thread answers each PING whatever
        # its application thread is doing, so only a peer that is not running or not reachable stays silent, and
        # libzmq then closes the connection (a socket monitor sees EVENT_DISCONNECTED) and reconnects.
        sock.setsockopt(zmq.HEARTBEAT_IVL, PEER_PING_INTERVAL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(peer_timeout * 1000))
    if max_message_bytes:  # per frame; a many-frame message is still buffered whole by libzmq before delivery
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
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


class MalformedMessage(Exception):
    """A peer sent something that is not one well-formed message; `identity` is who sent it, `kind` what was wrong
    (see wire_guard.Malformed), `payload` the one payload frame when there was exactly one and it passed the
    channel's depth check (so the caller can still read what it can of it)."""

    def __init__(self, identity: bytes, reason: str, payload: bytes | None = None, kind: str = "decode"):
        super().__init__(reason)
        self.identity = identity
        self.payload = payload
        self.kind = kind


class _Reader(Generic[T]):
    """What both channel kinds do with the frames they received: decode, or count, warn and refuse."""

    def __init__(self, socket: zmq.Socket, recv_type: Any, max_depth: int, name: str):
        self.socket = socket
        self._decoder: GuardedDecoder[T] | None = (GuardedDecoder(recv_type, max_depth) if recv_type is not None
                                                    else None)
        self.faults = FaultLog(name or socket.getsockopt_string(zmq.LAST_ENDPOINT) or "a socket")

    @property
    def num_malformed(self) -> int:
        """Messages received that were not one well-formed message (all kinds)."""
        return self.faults.total

    def _decode(self, buffer: memoryview) -> T:
        if self._decoder is None:
            raise TypeError("a send-only channel (recv_type=None) cannot receive")
        return self._decoder.decode(buffer)

    def _one(self, frames: list[zmq.Frame]) -> T | None:
        try:
            if len(frames) != 1:
                raise Malformed("frames", f"expected 1 frame, got {len(frames)}")
            return self._decode(frames[0].buffer)
        except Malformed as fault:
            self.faults.record(b"", fault)
            return None

    def _routed(self, frames: list[zmq.Frame]) -> tuple[bytes, T]:
        identity = frames[0].bytes
        try:
            if len(frames) != 2:
                raise Malformed("frames", f"expected 1 payload frame, got {len(frames) - 1}")
            return identity, self._decode(frames[1].buffer)
        except Malformed as fault:
            self.faults.record(identity, fault)
            payload = frames[1].bytes if fault.kind == "decode" else None  # within the depth limit: safe to read
            raise MalformedMessage(identity, str(fault), payload, fault.kind) from None


class Channel(_Reader[T]):
    """A synchronous socket that sends any wire Struct and decodes what it receives as `recv_type`.

    Args:
        kind: zmq.PUSH, zmq.PULL, zmq.ROUTER, zmq.DEALER.
        recv_type: the tagged union this end receives (None for a send-only socket).
        curve: authenticate a tcp:// endpoint with the launch's CURVE keys (see CurveKeys); ipc:// ignores it.
        max_message_bytes: the largest frame a peer may send (zmq.MAXMSGSIZE; 0: no limit).
        max_depth: refuse payloads nested deeper than this before decoding (0: no scan; see wire_guard).
        name: how warnings name the socket (default: its endpoint).
    """

    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool, recv_type: Any = None,
                 curve: bool = False, max_message_bytes: int = 0, max_depth: int = 0, name: str = ""):
        super().__init__(_open(ctx, kind, endpoint, bind, curve, max_message_bytes), recv_type, max_depth, name)

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

    def recv(self) -> T | None:
        """Block until one message arrives (DEALER/PULL); None when it was malformed (counted and logged)."""
        return self._one(self.socket.recv_multipart(copy=False))

    def recv_from(self) -> tuple[bytes, T]:
        """Block until one message arrives on a ROUTER; returns (peer identity, message).

        Raises:
            MalformedMessage: not exactly one payload frame, or a payload that does not decode (counted and
                logged already); carries the peer's identity so the caller can answer it.
        """
        return self._routed(self.socket.recv_multipart(copy=False))

    def poll(self, timeout_ms: int) -> bool:
        """True when a message is waiting (waits up to timeout_ms milliseconds)."""
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def close(self) -> None:
        self.socket.close(linger=0)


class AsyncChannel(_Reader[T]):
    """The asyncio twin of Channel (same arguments), for the frontend's event loop.

    Args:
        peer_timeout: seconds the peer may leave ZeroMQ's heartbeat (a PING every PEER_PING_INTERVAL_MS)
            unanswered before libzmq drops the connection (0: no heartbeat).
    """

    socket: zmq.asyncio.Socket  # what an asyncio context's socket() makes: its send and recv return awaitables

    def __init__(self, ctx: zmq.asyncio.Context, kind: int, endpoint: str, *, bind: bool, recv_type: Any = None,
                 curve: bool = False, max_message_bytes: int = 0, max_depth: int = 0, name: str = "",
                 peer_timeout: float = 0.0):
        super().__init__(_open(ctx, kind, endpoint, bind, curve, max_message_bytes, peer_timeout), recv_type,
                         max_depth, name)

    async def send(self, msg: msgspec.Struct, identity: bytes | None = None) -> None:
        payload = _ENCODER.encode(msg)
        if identity is None:
            await self.socket.send(payload, copy=False)
        else:
            await self.socket.send_multipart((identity, payload), copy=False)

    async def recv(self) -> T | None:
        """The next message (DEALER/PULL); None when it was malformed (counted and logged)."""
        return self._one(await self.socket.recv_multipart(copy=False))

    async def recv_from(self) -> tuple[bytes, T]:
        """(peer identity, message) from a ROUTER.

        Raises:
            MalformedMessage: as Channel.recv_from.
        """
        return self._routed(await self.socket.recv_multipart(copy=False))

    def has_unread(self) -> bool:
        """Whether a message has arrived that no recv has taken yet (the reader is behind)."""
        return bool(int(self.socket.get(zmq.EVENTS)) & zmq.POLLIN)

    def close(self) -> None:
        self.socket.close(linger=0)
