"""Issue 9: the WebSocket and the ZeroMQ batch socket under hostile input, in-process (the real app, a scripted
fake engine): lone-surrogate ids, Origin checks, abrupt closes, malformed multipart messages, API keys."""

import asyncio
import base64
import json
import logging
import os
import socket
import struct

import aiohttp
import msgspec
import pytest

from shuttle.common.config import ShuttleConfig
from shuttle.common.messages import BatchRequest
from shuttle.frontend.transports.ws_frames import CLOSE_FRAME, MaskedFramesOnly
from shuttle.launcher.cli import build_parser
from tests.batch_wire import dealer, next_response
from tests.inprocess import SCRIPT, start_app
from tests.server import MODEL_DIR

HANG = 30.0
KEY = "sk-batch-test"


@pytest.fixture(scope="module")
async def app():
    app = await start_app(api_key=KEY, batch=True, allowed_origins=("https://ok.example",))
    yield app
    await app.close()


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


async def collect_frames(ws, until_ids: set[str]) -> list[dict]:
    frames, open_ids = [], set(until_ids)
    while open_ids:
        frame = json.loads((await ws.receive(timeout=HANG)).data)
        frames.append(frame)
        if frame["type"] in ("done", "error"):
            open_ids.discard(frame["id"])
    return frames


async def test_lone_surrogate_id_gets_frames_and_the_socket_goes_on(app):
    async with aiohttp.ClientSession(headers=auth()) as session, session.ws_connect(f"{app.url}/v1/ws") as ws:
        # json.loads turns the escape into a lone surrogate, which UTF-8 cannot encode
        await ws.send_str('{"type": "generate", "id": "\\ud800", "prompt": "Hi", "max_tokens": 3}')
        await ws.send_str('{"type": "generate", "id": "\\udfff", "max_tokens": 3}')  # an error for this one
        await ws.send_str('{"type": "generate", "id": "next", "prompt": "Hi", "max_tokens": 2}')
        frames = await collect_frames(ws, {"\ud800", "\udfff", "next"})  # noqa: B033 (two lone surrogates, not one)
    ends = {f["id"]: f for f in frames if f["type"] in ("done", "error")}
    assert ends["\ud800"]["type"] == "done" and ends["\ud800"]["usage"]["completion_tokens"] == 3
    assert ends["\udfff"]["type"] == "error" and ends["\udfff"]["error"]["param"] == "prompt"
    assert ends["next"]["type"] == "done" and ends["next"]["usage"]["completion_tokens"] == 2
    assert [t for f in frames if f["type"] == "delta" and f["id"] == "\ud800" for t in f["token_ids"]] == SCRIPT[:3]


async def test_a_frame_nested_too_deeply_gets_an_error_frame_and_the_socket_goes_on(app):
    async with aiohttp.ClientSession(headers=auth()) as session, session.ws_connect(f"{app.url}/v1/ws") as ws:
        await ws.send_str("[" * 100_000 + "]" * 100_000)
        refused = json.loads((await ws.receive(timeout=HANG)).data)
        await ws.send_str('{"type": "generate", "id": "after", "prompt": "Hi", "max_tokens": 1}')
        frames = await collect_frames(ws, {"after"})
    assert refused["type"] == "error" and refused["error"]["message"] == "the frame is nested too deeply"
    assert frames[-1]["type"] == "done"


async def test_ids_are_echoed_as_sent_and_other_id_types_are_refused(app):
    async with aiohttp.ClientSession(headers=auth()) as session, session.ws_connect(f"{app.url}/v1/ws") as ws:
        await ws.send_str('{"type": "generate", "id": 5, "prompt": "Hi", "max_tokens": 2}')
        await ws.send_str('{"type": "generate", "id": "5", "prompt": "Hi", "max_tokens": 1}')  # another id than 5
        frames = await collect_frames(ws, {5, "5"})
        await ws.send_str('{"type": "generate", "id": [1], "prompt": "Hi", "max_tokens": 1}')
        refused = json.loads((await ws.receive(timeout=HANG)).data)
        await ws.send_str('{"type": "generate", "prompt": "Hi", "max_tokens": 1}')
        unnamed = await collect_frames(ws, {"gen-0"})
    ends = {(type(f["id"]), f["id"]): f for f in frames if f["type"] == "done"}
    assert ends[(int, 5)]["usage"]["completion_tokens"] == 2 and ends[(str, "5")]["usage"]["completion_tokens"] == 1
    assert all(f["id"] in (5, "5") for f in frames)
    assert refused["type"] == "error" and refused["id"] == [1] and refused["error"]["param"] == "id"
    assert unnamed[-1]["type"] == "done" and unnamed[-1]["id"] == "gen-0"


async def test_origin_must_be_own_or_allowed(app):
    async with aiohttp.ClientSession(headers=auth()) as session:
        for origin, allowed in [("https://evil.example", False), ("https://ok.example", True), (app.url, True),
                                (None, True), ("null", False)]:
            headers = {"Origin": origin} if origin else {}
            try:
                async with session.ws_connect(f"{app.url}/v1/ws", headers=headers) as ws:
                    await ws.close()
                upgraded = True
            except aiohttp.WSServerHandshakeError as exc:
                assert exc.status == 403
                upgraded = False
            assert upgraded == allowed, origin


def ws_frame(text: str) -> bytes:
    """A masked client text frame (RFC 6455)."""
    payload, mask = text.encode(), os.urandom(4)
    length = len(payload)
    header = bytes([0x81]) + (bytes([0x80 | length]) if length < 126 else bytes([0x80 | 126]) + struct.pack(">H",
                                                                                                            length)
                              if length < 2**16 else bytes([0x80 | 127]) + struct.pack(">Q", length))
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_abrupt_close_with_many_generations_is_logged_once(app, caplog):
    caplog.set_level(logging.INFO, logger="shuttle.frontend")
    app.engine.step_delay = 0.02
    try:
        reader, writer = await raw_websocket(app)
        writer.write(b"".join(ws_frame(json.dumps({"type": "generate", "id": str(i), "prompt": "Hi",
                                                   "max_tokens": 8})) for i in range(200)))
        while app.engine.num_in_flight < 200:
            await asyncio.sleep(0.01)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # a reset with 200 generations in flight
        deadline = asyncio.get_running_loop().time() + HANG
        while app.engine.num_in_flight:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
    finally:
        app.engine.step_delay = 0.0
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]
    abrupt = [r for r in caplog.records if "closed abruptly" in r.getMessage()]
    assert len(abrupt) <= 1


def completion(job_id: str, key: str = KEY, **body) -> bytes:
    return msgspec.msgpack.encode(BatchRequest(job_id=job_id, url="/v1/completions", body={"prompt": "Hi",
                                                                                           "max_tokens": 2, **body},
                                               api_key=key))


async def test_batch_endpoint_survives_malformed_messages(app):
    sock = await dealer(app.batch.endpoint)
    try:
        good = completion("ok")
        for frames, job_id, param in (
                ([good, good], "", None), ([b"\x00\xff\x13"], "", None),
                ([msgspec.msgpack.encode({"type": "request", "job_id": 1})], "", "job_id"),
                ([msgspec.msgpack.encode({"type": "request", "job_id": "named", "url": 5, "body": {}})], "named",
                 "url"),
                ([b"", b"", b""], "", None)):
            await sock.send_multipart(frames)
            result = await next_response(sock)
            assert (result.job_id, result.status_code) == (job_id, 400)
            assert "malformed" in result.body["error"]["message"] and result.body["error"]["param"] == param
        await sock.send(good)
        result = await next_response(sock)
        assert result.status_code == 200 and result.body["choices"][0]["finish_reason"] == "length"
    finally:
        sock.close()


async def test_batch_jobs_need_the_api_key(app):
    sock = await dealer(app.batch.endpoint)
    submitted = len(app.engine.submitted)
    try:
        for key in ("", "wrong"):
            await sock.send(completion(f"key-{key}", key=key))
            result = await next_response(sock)
            assert (result.job_id, result.status_code, result.body["error"]["type"]) == (
                f"key-{key}", 401, "authentication_error")
        assert len(app.engine.submitted) == submitted  # refused before any work
    finally:
        sock.close()


def test_batch_endpoint_is_loopback_even_when_http_listens_everywhere():
    args = build_parser().parse_args(["serve", str(MODEL_DIR), "--host", "0.0.0.0", "--port", "9000"])
    assert ShuttleConfig.from_args(args, None).batch_endpoint == "tcp://127.0.0.1:9001"
    args = build_parser().parse_args(["serve", str(MODEL_DIR), "--host", "0.0.0.0", "--batch-endpoint",
                                      "tcp://0.0.0.0:7000"])
    assert ShuttleConfig.from_args(args, None).batch_endpoint == "tcp://0.0.0.0:7000"


# ---- unmasked client frames close the connection (RFC 6455, section 5.1; issue 24) ------------------------------

def unmasked_frame(text: str) -> bytes:
    payload = text.encode()
    assert len(payload) < 126
    return bytes([0x81, len(payload)]) + payload


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of each frame in `data`, a server's (unmasked) frames."""
    frames, pos = [], 0
    while pos + 2 <= len(data):
        opcode, length, pos = data[pos] & 0x0F, data[pos + 1] & 0x7F, pos + 2
        if length == 126:
            length, pos = struct.unpack_from(">H", data, pos)[0], pos + 2
        elif length == 127:
            length, pos = struct.unpack_from(">Q", data, pos)[0], pos + 8
        frames.append((opcode, data[pos:pos + length]))
        pos += length
    return frames


async def raw_websocket(app) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A handshaken WebSocket connection over a plain socket (the client library always masks)."""
    host, port = app.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /v1/ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer {KEY}\r\n\r\n"
                  ).encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


async def test_unmasked_client_frame_closes_the_connection_with_1002(app, caplog):
    caplog.set_level(logging.INFO)
    reader, writer = await raw_websocket(app)
    generate = json.dumps({"type": "generate", "id": "masked", "prompt": "Hi", "max_tokens": 2})
    writer.write(ws_frame(generate))
    received = b""
    while not any(op == 1 and json.loads(p)["type"] == "done" for op, p in server_frames(received)):
        received += await asyncio.wait_for(reader.read(65536), HANG)  # the masked frame is served
    app.engine.step_delay = 0.05
    try:  # a masked generate, then an unmasked frame in the same segment: the first is read, then the close
        writer.write(ws_frame(json.dumps({"type": "generate", "id": "long", "prompt": "Hi", "max_tokens": 8})) +
                     unmasked_frame(json.dumps({"type": "generate", "id": "bare", "prompt": "Hi", "max_tokens": 2})))
        rest = await asyncio.wait_for(reader.read(), HANG)  # until the server closes the connection
        writer.close()
        deadline = asyncio.get_running_loop().time() + HANG
        while app.engine.num_in_flight:  # the generation on the closed socket is aborted
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
    finally:
        app.engine.step_delay = 0.0
    opcode, payload = server_frames(rest)[-1]
    assert opcode == 0x8 and struct.unpack(">H", payload[:2])[0] == 1002, rest  # a close frame, protocol error
    assert not any(op == 1 and json.loads(p)["id"] == "bare" for op, p in server_frames(rest))
    assert not any(r.exc_info or r.levelno >= logging.WARNING for r in caplog.records), caplog.text
    async with aiohttp.ClientSession(headers=auth()) as session, session.ws_connect(f"{app.url}/v1/ws") as ws:
        await ws.send_str(generate)  # the server goes on
        assert (await collect_frames(ws, {"masked"}))[-1]["type"] == "done"


def test_mask_screen_follows_frame_boundaries_across_any_chunking():
    class Reader:
        def __init__(self):
            self.fed = bytearray()

        def feed_data(self, data):
            self.fed += data
            return False, b""

    masked = [ws_frame("x" * n) for n in (0, 5, 125, 126, 300, 70_000)]  # 7-bit, 16-bit and 64-bit lengths
    good = b"".join(masked)
    stream = good + unmasked_frame("bare") + ws_frame("never read")
    for chunk in (1, 2, 7, 131, 65536, len(stream)):
        reader, refusals = Reader(), []
        screen = MaskedFramesOnly(reader, refusals.append)
        for start in range(0, len(stream), chunk):
            screen.feed_data(stream[start:start + chunk])
        assert refusals == [CLOSE_FRAME], chunk
        assert bytes(reader.fed[:len(good)]) == good and len(reader.fed) <= len(good) + 1, chunk


async def test_invalid_requests_are_counted_whichever_transport_carried_them(app):
    """request_rejected{reason="invalid"} counted HTTP's 400s only; the batch endpoint and the WebSocket carry the
    same requests, and each transport's own refusals (a message it cannot read, an id already in use) are 400s for
    invalid requests too, as HTTP's for a body that is not JSON."""
    invalid = app.state.metrics.rejected.labels("invalid")
    before = invalid._value.get()
    app.engine.step_delay = 0.05
    sock = await dealer(app.batch.endpoint)
    try:
        await sock.send(completion("bad", max_tokens=-1))
        assert (await next_response(sock)).status_code == 400
        await sock.send(b"\xc1")  # not msgpack
        assert (await next_response(sock)).status_code == 400
        await sock.send(completion("same", max_tokens=4))
        await sock.send(completion("same", max_tokens=4))
        assert [(await next_response(sock)).status_code for _ in range(2)] == [400, 200]
    finally:
        app.engine.step_delay = 0.0
        sock.close()
    async with aiohttp.ClientSession(headers=auth()) as session, session.ws_connect(f"{app.url}/v1/ws") as ws:
        await ws.send_str('{"type": "generate", "id": "bad", "prompt": "Hi", "max_tokens": -1}')
        frames = await collect_frames(ws, {"bad"})
        await ws.send_str("{not json")
        assert (await ws.receive_json())["error"]["code"] == 400
        async with session.post(f"{app.url}/v1/completions", json={"prompt": "Hi", "max_tokens": -1}) as response:
            assert response.status == 400
    assert frames[-1]["type"] == "error" and frames[-1]["error"]["param"] == "max_tokens"
    assert invalid._value.get() == before + 6


async def test_an_unnamed_generate_is_never_named_after_a_running_one():
    """A fresh-clone trial: a client's own "gen-1" ran, and the second id-less generate, named "gen-1" too, was
    refused as a duplicate under that id, so "gen-1" got an error and a done. Unnamed generates skip the names in
    use: each of the three ends once."""
    slow = await start_app(api_key=KEY, step_delay=0.05)
    try:
        async with aiohttp.ClientSession(headers=auth()) as session, \
                session.ws_connect(f"{slow.url}/v1/ws") as ws:
            await ws.send_str('{"type": "generate", "id": "gen-1", "prompt": "Hi", "max_tokens": 6}')
            await ws.send_str('{"type": "generate", "prompt": "Hi", "max_tokens": 1}')
            await ws.send_str('{"type": "generate", "prompt": "Hi", "max_tokens": 1}')
            frames = await collect_frames(ws, {"gen-0", "gen-1", "gen-2"})
    finally:
        await slow.close()
    ends = [(f["id"], f["type"]) for f in frames if f["type"] in ("done", "error")]
    assert sorted(ends) == [("gen-0", "done"), ("gen-1", "done"), ("gen-2", "done")]
    assert [f["usage"]["completion_tokens"] for f in frames if f["type"] == "done" and f["id"] == "gen-1"] == [6]
