"""Issue 9: the HTTP listener's edges, in-process (the real app and listener, a scripted fake engine), over raw
sockets so that partial heads, slow bodies and half-closes are exactly what the test sends.

Every wait here is a bound that only a hang exceeds; none measures speed.
"""

import asyncio
import json
import logging
import socket

import pytest

from tests.inprocess import SCRIPT, start_app

HANG = 30.0  # seconds: only a server that never answers or never closes gets here

REQUEST_BODY = json.dumps({"prompt": "Hi", "max_tokens": 4}).encode()


def head(content_length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n\r\n").encode()


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (fails on a hang)."""
    return await asyncio.wait_for(reader.read(), HANG)


@pytest.fixture(scope="module")
async def app():
    app = await start_app(header_timeout=0.5, keep_alive_timeout=1.0, body_timeout=0.5, step_delay=0.05)
    yield app
    await app.close()


@pytest.fixture(scope="module")
async def patient_app():
    """Keep-alive far beyond HANG: only the header timer can close a connection in time here."""
    app = await start_app(header_timeout=0.5, keep_alive_timeout=10 * HANG, step_delay=0.05)
    yield app
    await app.close()


@pytest.mark.parametrize("partial", [b"POST /v1/comple",  # inside the request line
                                     b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"])  # inside the headers
async def test_partial_head_is_closed_after_the_header_timeout(patient_app, partial):
    reader, writer = await connect(patient_app.url)
    writer.write(partial)  # and never the rest
    assert await read_until_closed(reader) == b""
    writer.close()


async def test_idle_connection_is_closed_after_the_keep_alive_timeout(app):
    reader, writer = await connect(app.url)  # sends nothing at all
    assert await read_until_closed(reader) == b""
    writer.close()
    reader, writer = await connect(app.url)  # one request, then idle
    writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    answer = await read_until_closed(reader)
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
    writer.close()


async def test_slow_body_gets_408_and_the_connection_closes(app):
    reader, writer = await connect(app.url)
    writer.write(head(100) + b'{"prompt":')  # 10 of 100 bytes, then nothing
    answer = await read_until_closed(reader)
    assert answer.startswith(b"HTTP/1.1 408")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408
    writer.close()


async def test_content_length_over_the_limit_is_413_before_any_body_is_sent(app):
    reader, writer = await connect(app.url)
    writer.write(head(10**9))  # no body follows; the answer must not wait for one
    status_line = await asyncio.wait_for(reader.readline(), HANG)
    assert status_line.startswith(b"HTTP/1.1 413")
    writer.close()


async def test_half_closed_client_still_gets_its_answer(app):
    for stream in (False, True):
        body = json.dumps({"prompt": "Hi", "max_tokens": 8, "stream": stream}).encode()
        sock = socket.create_connection(app.url.removeprefix("http://").split(":"), timeout=HANG)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(head(len(body)) + body)
        await writer.drain()
        sock.shutdown(socket.SHUT_WR)  # "that is all I have to say": a FIN, reading side still open
        answer = await read_until_closed(reader)
        writer.close()
        final = answer[answer.index(b"HTTP/1.1 200"):]  # after any interim 100 Continue
        payload = final.split(b"\r\n\r\n", 1)[1]
        if stream:
            assert payload.count(b"data: ") == len(SCRIPT) + 1 and b"data: [DONE]" in payload
        else:
            assert b'"finish_reason": "length"' in payload and b'"completion_tokens": 8' in payload


async def test_client_that_leaves_mid_request_is_still_noticed(app):
    """A FIN looks like a half-close; a client that really left is found by the interim probe."""
    app.engine.step_delay = 2.0  # 8 tokens: 16 s unless the request is aborted
    try:
        sock = socket.create_connection(app.url.removeprefix("http://").split(":"), timeout=HANG)
        body = json.dumps({"prompt": "Hi", "max_tokens": 8}).encode()
        sock.sendall(head(len(body)) + body)
        await wait_for(lambda: app.engine.num_in_flight == 1)
        sock.close()  # gone for good
        await wait_for(lambda: app.engine.num_in_flight == 0, within=10.0)
    finally:
        app.engine.step_delay = 0.05


async def test_malformed_http_is_one_warning_without_traceback(app, caplog):
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    reader, writer = await connect(app.url)
    writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\nthis is not a header\r\n\r\n")
    answer = await read_until_closed(reader)
    writer.close()
    assert answer.split(b" ", 2)[1] == b"400"
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [r.levelno for r in records] == [logging.WARNING], records
    assert "malformed HTTP request" in records[0].getMessage() and records[0].exc_info is None


async def wait_for(condition, within: float = HANG) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.02)
