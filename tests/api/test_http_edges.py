"""Issue 9: the HTTP listener's edges, in-process (the real app and listener, a scripted fake engine), over raw
sockets so that partial heads, slow bodies and half-closes are exactly what the test sends.

Every wait here is a bound that only a hang exceeds; none measures speed.
"""

import asyncio
import gzip
import json
import logging
import socket
import zlib

import aiohttp
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


# ---- request body encodings (issue 24): decoded after the key check, every failure an OpenAI 4xx, never a trace ---

KEY = "sk-edges"
POSTS = {"/v1/completions": {"prompt": "Hi", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
         "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [1, 403]}}
PLAIN = json.dumps({"prompt": "Once upon a time"}).encode()  # for /tokenize
NOT_ENCODED = [("gzip", PLAIN), ("deflate", PLAIN), ("x-gzip", PLAIN), ("gzip", gzip.compress(PLAIN)[:-6]),
               ("deflate", zlib.compress(PLAIN)[:-3]), ("gzip", gzip.compress(PLAIN) + b"tail"),
               ("gzip", b"\x1f\x8b" + bytes(range(256)) * 4)]


@pytest.fixture(scope="module")
async def keyed_app():
    app = await start_app(api_key=KEY)
    yield app
    await app.close()


async def post_encoded(session: aiohttp.ClientSession, url: str, data: bytes, encoding: str, **headers
                       ) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding, **headers}
    async with session.post(url, data=data, headers=headers) as response:
        return response.status, json.loads(await response.text())


def log_lines(caplog) -> list[str]:
    assert all(r.exc_info is None for r in caplog.records), caplog.text
    return caplog.text.splitlines()


@pytest.mark.parametrize("path", POSTS)
async def test_body_that_is_not_validly_encoded_is_400_with_at_most_one_log_line(app, caplog, path):
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession() as session:  # one connection: it stays usable after each refusal
        for encoding, data in NOT_ENCODED:
            caplog.clear()
            status, body = await post_encoded(session, f"{app.url}{path}", data, encoding)
            assert status == 400 and body["error"]["code"] == 400, (encoding, data[:20], body)
            assert encoding.removeprefix("x-") in body["error"]["message"]
            assert len(log_lines(caplog)) <= 1, caplog.text
        async with session.post(f"{app.url}{path}", json=POSTS[path]) as response:
            assert response.status == 200


async def test_encoded_bodies_are_decoded(app):
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw_deflate = raw_deflate.compress(PLAIN) + raw_deflate.flush()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{app.url}/tokenize", data=PLAIN, headers={"Content-Type": "application/json"}) as r:
            expected = await r.json()
        for encoding, data in [("gzip", gzip.compress(PLAIN)), ("x-gzip", gzip.compress(PLAIN)),
                               ("deflate", zlib.compress(PLAIN)), ("deflate", raw_deflate), ("identity", PLAIN),
                               ("GZIP, identity", gzip.compress(PLAIN)), ("", PLAIN)]:
            status, body = await post_encoded(session, f"{app.url}/tokenize", data, encoding)
            assert (status, body) == (200, expected), encoding


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "x-unheard-of", "gzip, gzip", "deflate, gzip"])
async def test_unsupported_content_encoding_is_415_naming_it(app, caplog, encoding):
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession() as session:
        for path in POSTS:
            status, body = await post_encoded(session, f"{app.url}{path}", PLAIN, encoding)
            assert status == 415 and body["error"]["code"] == 415, body
            assert repr(encoding) in body["error"]["message"]
    assert log_lines(caplog) == []


async def test_body_over_the_limit_once_decoded_is_413(app):
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (64 * 2**20) + b'"}')  # 64 MiB in about 64 KiB
    async with aiohttp.ClientSession() as session:
        status, body = await post_encoded(session, f"{app.url}/v1/completions", bomb, "gzip")
    assert status == 413 and "once decoded" in body["error"]["message"]


async def test_unauthenticated_request_is_refused_before_its_body_is_decoded(keyed_app, caplog):
    caplog.set_level(logging.DEBUG)
    async with aiohttp.ClientSession() as session:
        for path in POSTS:
            for encoding, data in NOT_ENCODED + [("br", PLAIN)]:
                caplog.clear()
                status, body = await post_encoded(session, f"{keyed_app.url}{path}", data, encoding)
                assert status == 401 and body["error"]["code"] == 401
                assert log_lines(caplog) == []
        status, body = await post_encoded(session, f"{keyed_app.url}/tokenize", PLAIN, "gzip",
                                          Authorization=f"Bearer {KEY}")
        assert status == 400 and "gzip" in body["error"]["message"]  # with the key, it gets to be decoded
