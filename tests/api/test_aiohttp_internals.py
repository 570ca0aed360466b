"""The private attributes of aiohttp's RequestHandler that frontend/web/server.py reads (AIOHTTP_PRIVATE, checked
against aiohttp AIOHTTP_CHECKED) still exist and still mean what it reads them for, on a live connection: this
fails when an aiohttp release renames or repurposes one of them.

Every wait here is a bound that only a hang exceeds; none measures speed.
"""

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from shuttle.frontend.web.server import AIOHTTP_PRIVATE, ShuttleRequestHandler
from tests.inprocess import start_app

HANG = 30.0


def test_every_private_attribute_read_is_a_slot_of_the_request_handler():
    slots = {name for cls in RequestHandler.__mro__ for name in getattr(cls, "__slots__", ())}
    assert set(AIOHTTP_PRIVATE) <= slots


async def until(condition, what: str) -> None:
    try:
        async with asyncio.timeout(HANG):
            while not condition():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"not within {HANG:g} s: {what}") from None


async def test_each_private_attribute_tells_what_the_listener_reads_it_for():
    app = await start_app(step_delay=0.05)
    host, port = app.url.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        await until(lambda: app.runner.server.connections, "the connection is accepted")
        [handler] = app.runner.server.connections
        assert isinstance(handler, ShuttleRequestHandler)
        # a fresh connection that sent nothing: no request started, none queued or handled, not a WebSocket
        assert (handler._request_count, len(handler._messages), handler._current_request) == (0, 0, None)
        assert handler._upgraded is False
        body = json.dumps({"prompt": "Hi", "max_tokens": 4}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # while it is answered (four outputs 50 ms apart): the request being handled, no waiter for a next head
        await until(lambda: handler._current_request is not None, "the request is handled")
        assert isinstance(handler._current_request, web.BaseRequest) and handler._request_count == 1
        assert handler._waiter is None
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG)
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                     .split(b":")[1])
        await asyncio.wait_for(reader.readexactly(length), HANG)
        # answered, kept alive: start() awaits its waiter for the next head, and nothing is being handled
        await until(lambda: handler._waiter is not None, "waiting for the next request head")
        assert isinstance(handler._waiter, asyncio.Future) and not handler._waiter.done()
        assert handler._current_request is None and not handler._messages
        writer.close()
        await until(lambda: not app.runner.server.connections, "the connection is closed")
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{app.url}/v1/ws"):
            [handler] = app.runner.server.connections
            assert handler._upgraded is True  # the connection now belongs to the WebSocket
    finally:
        await app.close()
