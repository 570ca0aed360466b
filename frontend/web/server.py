"""The HTTP listener: aiohttp's request handler with its edges hardened.

- Idle keep-alive: an idle connection (one that never sent a request included) closes after
  `keep_alive_timeout` seconds (aiohttp's own timer).
- Request head: once a client has started a request head it has `header_timeout` seconds to finish it.
- Request body: `body_timeout` seconds to send it once the head has arrived (HTTP 408, then the connection
  closes), and a Content-Length over the limit is answered with 413 before a byte of the body is read.
- Half-close: a client that shuts down its sending side after its request still gets the answer. A TCP FIN
  looks the same whether the client half-closed or left altogether, so until the response starts the
  connection is probed with an interim `100 Continue` (every HTTP/1.1 client must accept unsolicited 1xx
  responses) every PROBE_INTERVAL_S: a client that has really gone answers with a reset, which ends the
  connection and so aborts its request.
- Request body encodings: aiohttp's own decompression is off; frontend/web/content_coding.py decodes a body after
  authentication, under the same limit (400 for a body that is not validly encoded, 413 over the limit once
  decoded, 415 for a coding not supported), and `request_body()` gives a handler the decoded bytes.
- WebSocket frames from a client must be masked (RFC 6455, section 5.1): aiohttp's frame reader serves clients
  too and does not check, so frontend/transports/ws_frames.py screens the bytes before it (close code 1002 otherwise).
- Malformed HTTP is one WARNING line naming the peer and the parser's complaint, never a traceback; a client
  that leaves while its answer is being written is not a server error (DEBUG).

aiohttp has no public hook for these, so `ShuttleRequestHandler` subclasses its RequestHandler, overrides its
`set_parser` (where a WebSocket hands over its frame reader) and reads the few private attributes named in
AIOHTTP_PRIVATE, each read marked where it is made. tests/api/test_aiohttp_internals.py fails when aiohttp no longer has
one of them; tests/api/test_http_edges.py and tests/api/test_ws_batch_edges.py exercise what each is read for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from shuttle.common.config import OpsConfig
from shuttle.common.unix_socket import unix_socket_problem
from shuttle.frontend.request.errors import error_body
from shuttle.frontend.transports.ws_frames import MaskedFramesOnly
from shuttle.frontend.web.access_log import RequestAccessLogger
from shuttle.frontend.web.content_coding import BodyRefused, content_coding, decode

log = logging.getLogger("shuttle.frontend")

PROBE_INTERVAL_S = 0.5
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# uvicorn's access line ('127.0.0.1 - "GET /health HTTP/1.1" 200') plus the bytes sent and the seconds taken
ACCESS_LOG_FORMAT = '%a - "%r" %s %b %Tf'  # what RequestAccessLogger writes (aiohttp's format string for it)
LISTEN_BACKLOG = 4096  # a burst of thousands of clients connecting at once should queue, not be refused
BODY = web.RequestKey("shuttle_body", bytes)  # the request body, decoded from its Content-Encoding
# RequestHandler's private attributes read below, checked against aiohttp 3.14.5 (tests/api/test_aiohttp_internals.py):
#   _waiter: the future start() awaits for the next request head (None while one is queued or handled)
#   _messages: request heads parsed and not yet taken by start()
#   _current_request: the request being handled (None between requests)
#   _request_count: requests the connection has started (0: a fresh connection)
#   _upgraded: the connection was handed to a WebSocket (BaseProtocol's)
AIOHTTP_CHECKED = "3.14.5"
AIOHTTP_PRIVATE = ("_waiter", "_messages", "_current_request", "_request_count", "_upgraded")


class ShuttleRequestHandler(RequestHandler):
    """aiohttp's protocol for one connection, plus a request-head timer and half-close handling."""

    __slots__ = ("_header_timeout", "_header_timer", "_probe")

    def __init__(self, manager: web.Server, *, header_timeout: float, **kwargs):
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None
        self._probe: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Waiting for a request head: between requests (start() awaits its waiter), or on a fresh connection whose
        # first head is still incomplete, where data can arrive before start() has created its waiter at all.
        # (private attributes of aiohttp 3.14.5: AIOHTTP_PRIVATE)
        idle = (self._waiter is not None and not self._waiter.done()) or (
            self._request_count == 0 and not self._messages)
        if idle and data and self._header_timer is None and self._header_timeout > 0:
            self._header_timer = asyncio.get_running_loop().call_later(self._header_timeout, self._head_overdue)
        elif not idle and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def set_parser(self, parser, data_received_cb=None) -> None:
        """A WebSocket's frame reader takes over the connection: screen its bytes for unmasked frames first."""
        # aiohttp annotates the parser as its WebSocketReader, but only calls the feed_data/feed_eof it wraps
        super().set_parser(MaskedFramesOnly(parser, self._refuse_unmasked), data_received_cb)  # type: ignore[arg-type]

    def _refuse_unmasked(self, close_frame: bytes) -> None:
        if self.transport is not None:
            log.info("closing a websocket from %s: it sent an unmasked frame (RFC 6455, section 5.1)",
                     self.transport.get_extra_info("peername"))
            self.transport.write(close_frame)
        self.force_close()

    def _head_overdue(self) -> None:
        self._header_timer = None
        # (a private attribute of aiohttp 3.14.5: AIOHTTP_PRIVATE)
        if self._waiter is not None and not self._waiter.done() and self.transport is not None:
            log.info("closing a connection from %s: request head incomplete after %g s",
                     self.transport.get_extra_info("peername"), self._header_timeout)
            self.force_close()

    # asyncio.Protocol.eof_received returns bool | None (True: keep the transport); aiohttp narrowed it to None
    def eof_received(self) -> bool | None:  # type: ignore[override]
        """Keep a half-closed connection open while its request is answered; close an idle one at once."""
        # Idle: waiting for a request head (or never sent a byte). Otherwise a request is queued or being handled
        # (start() may have taken it off the queue without its handler having run yet: _waiter is then None).
        # (private attributes of aiohttp 3.14.5: AIOHTTP_PRIVATE)
        idle = not self._messages and self._current_request is None and (
            self._waiter is not None or self._request_count == 0)
        if self._upgraded or idle:
            return None  # nothing asked (or a WebSocket): the client is gone
        self.close()  # no further requests can come; the connection closes after this answer
        self._probe_peer()
        return True

    def _probe_peer(self) -> None:
        self._probe = None
        if self.transport is None:
            return
        request = self._current_request  # (a private attribute of aiohttp 3.14.5: AIOHTTP_PRIVATE)
        if request is not None and request.writer.output_size > 0:
            return  # answering: the response's own writes detect a client that left
        if request is not None:
            self.transport.write(CONTINUE)  # to a client that closed altogether, this draws a reset
        self._probe = asyncio.get_running_loop().call_later(PROBE_INTERVAL_S, self._probe_peer)

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._header_timer, self._probe):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def log_exception(self, *args, **kwargs) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, ConnectionResetError):  # the client left while its answer was being written
            self.logger.debug("client gone while answering: %s", exc)
            return
        if isinstance(exc, HttpProcessingError):
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            self.logger.warning("malformed HTTP request from %s: %s", peer, exc.message or exc)
            return
        super().log_exception(*args, **kwargs)


async def listen(runner: web.AppRunner, host: str, port: int, ops: OpsConfig, *, uds: str | None = None,
                 access_log: logging.Logger | None = None) -> asyncio.Server:
    """Accept connections on host:port, or on the Unix domain socket at `uds` instead (--uds), with
    ShuttleRequestHandler (after `runner.setup()`), one `access_log` line per request (None: none). Close the
    returned server to stop accepting; `runner.cleanup()` then ends the connections.

    Raises:
        OSError: the address cannot be listened on (for `uds`: a server already answers on it, or its directory
            does not exist or cannot be written).
    """
    loop = asyncio.get_running_loop()
    manager = runner.server
    assert manager is not None  # made by runner.setup()

    def protocol() -> ShuttleRequestHandler:
        # auto_decompress off: request_limits decodes bodies, after the API key check (see content_coding.py)
        return ShuttleRequestHandler(manager, loop=loop, keepalive_timeout=ops.keep_alive_timeout,
                                     header_timeout=ops.header_timeout, access_log=access_log,
                                     access_log_class=RequestAccessLogger, access_log_format=ACCESS_LOG_FORMAT,
                                     auto_decompress=False)

    if uds:
        _refuse_live_socket(uds)
        return await loop.create_unix_server(protocol, uds, backlog=LISTEN_BACKLOG)
    return await loop.create_server(protocol, host, port, reuse_address=True, backlog=LISTEN_BACKLOG,
                                    family=socket.AF_UNSPEC)


def listen_url(host: str, server: asyncio.Server, uds: str | None = None) -> str:
    """Where `server` (from listen) answers: http://HOST:PORT with the port it got, or unix:PATH on a Unix socket
    (vLLM's name for it; `curl --unix-socket PATH http://localhost/health` reaches it)."""
    if uds:
        return f"unix:{uds}"
    return f"http://{host}:{server.sockets[0].getsockname()[1]}"


def _refuse_live_socket(path: str) -> None:
    """asyncio replaces a socket file left at `path` (by a server that ended without removing it); one that a
    server still accepts on is refused instead of being taken from it (common/unix_socket.py)."""
    problem = unix_socket_problem(path)
    if problem is not None:
        raise OSError(f"the Unix socket {path}: {problem}")


def remove_socket_file(path: str) -> None:
    """Remove the Unix socket file `path` this server listened on (when it is still a socket)."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.remove(path)
    except OSError:
        pass  # gone already, or not ours to remove


def access_logger(level: str) -> logging.Logger | None:
    """aiohttp's access logger (`aiohttp.access`, one INFO line per request) set to --uvicorn-log-level `level`
    ("trace" is DEBUG: uvicorn's level below debug); None when `level` hides its lines, so none is formatted."""
    logger = logging.getLogger("aiohttp.access")
    logger.setLevel(logging.DEBUG if level == "trace" else getattr(logging, level.upper()))
    return logger if logger.isEnabledFor(logging.INFO) else None


def request_limits(max_body_bytes: int, body_timeout: float):
    """Middleware: 413 from Content-Length before reading, 415 for a Content-Encoding not supported, the body read
    under `body_timeout` (408) and decoded under the limit (400, 413); the handler finds it with request_body()."""

    @web.middleware
    async def limits(request: web.Request, handler) -> web.StreamResponse:
        if request.can_read_body:
            if request.content_length is not None and request.content_length > max_body_bytes:
                # answered before the body is read; aiohttp then reads and drops the body for a bounded time
                # (its lingering close), so the client, still sending, gets to read this answer
                return web.json_response(error_body(413, f"request body of {request.content_length} bytes is over "
                                                         f"the limit of {max_body_bytes}"), status=413)
            try:
                coding = content_coding(request.headers.get(hdrs.CONTENT_ENCODING, ""))
            except BodyRefused as exc:
                return web.json_response(error_body(exc.status, str(exc)), status=exc.status)
            try:
                async with asyncio.timeout(body_timeout if body_timeout > 0 else None):
                    raw = await request.read()
            except TimeoutError:
                return await _answer_and_close(request, 408, f"request body not received within {body_timeout:g} s")
            except RequestPayloadError as exc:
                # the parser could not read the body (a listener that decompresses, as aiohttp's test server):
                # the connection cannot go on, and closing it skips aiohttp's lingering read, which would log
                detail = getattr(exc.__cause__, "message", None) or "it is not validly encoded"
                return await _answer_and_close(request, 400, f"request body could not be read: {detail}")
            if request.content.total_compressed_bytes is not None:
                coding = None  # that parser has decoded it already
            try:
                request[BODY] = decode(raw, coding, max_body_bytes)
            except BodyRefused as exc:
                return web.json_response(error_body(exc.status, str(exc)), status=exc.status)
        return await handler(request)

    return limits


async def request_body(request: web.Request) -> bytes:
    """The request's body, decoded from its Content-Encoding by request_limits (read as sent without it)."""
    body = request.get(BODY)
    return body if body is not None else await request.read()


async def _answer_and_close(request: web.Request, status: int, message: str) -> web.Response:
    """Send an OpenAI error answer, then close the connection at once: a body that is late is not waited for
    (aiohttp would otherwise keep reading it for its lingering time)."""
    response = web.json_response(error_body(status, message), status=status)
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response
