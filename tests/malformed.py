"""Malformed ZeroMQ messages of every kind, for the tests that throw them at shuttle's socket readers
(tests/api/test_zmq_hostile.py, tests/e2e/test_fuzz.py), and a raw ZMTP peer that can announce a frame of any size.

Each kind is a list of frames as a DEALER or PUSH sends them (payload frames only: a ROUTER adds the identity).
"""

from __future__ import annotations

import asyncio
import struct

import msgspec
from hypothesis import strategies as st

from shuttle.common.messages import BatchRequest


def nested(depth: int, container: bytes = b"\x91") -> bytes:
    """`depth` nested one-element msgpack arrays (or another one-element container head) around a nil."""
    return container * depth + b"\xc0"


def deep_request(depth: int) -> bytes:
    """The issue's repro: the map {"type": "request", "body": X}, X being `depth` nested one-element arrays."""
    return b"\x82" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("request") + \
        msgspec.msgpack.encode("body") + nested(depth)


def batch_job(job_id: str, key: str = "", **body) -> bytes:
    return msgspec.msgpack.encode(BatchRequest(job_id=job_id, url="/v1/completions", body={"prompt": "Hi",
                                                                                           "max_tokens": 2, **body},
                                               api_key=key))


# kind -> (frames, the job id a refusal can still name)
def batch_kinds(key: str) -> dict[str, tuple[list[bytes], str]]:
    """Every kind of malformed message for the batch endpoint (a ROUTER decoding BatchClientMessage)."""
    good = batch_job("good", key)
    pack = msgspec.msgpack.encode
    return {
        "never-used byte": ([b"\xc1"], ""),
        "trailing bytes": ([b"\x00\xff\x13"], ""),
        "truncated": ([good[:-3]], ""),
        "empty frame": ([b""], ""),
        "too many frames": ([good, good], ""),
        "three empty frames": ([b"", b"", b""], ""),
        "nil": ([pack(None)], ""),
        "top-level array": ([pack([1, 2, 3])], ""),
        "wrong field type": ([pack({"type": "request", "job_id": "typed", "url": 5, "body": {}})], "typed"),
        "job id not a string": ([pack({"type": "request", "job_id": 1, "url": "/v1/completions"})], ""),
        "unknown type tag": ([pack({"type": "launch", "job_id": "tagged"})], "tagged"),
        "no type": ([pack({"job_id": "untyped", "url": "/v1/completions", "body": {}})], "untyped"),
        # a trial: a field beside body (meant inside it) was ignored without a word
        "unknown field": ([pack({"type": "request", "job_id": "beside", "url": "/v1/completions", "body": {},
                                 "api_key": key, "priority": -7})], "beside"),
        "invalid utf-8": ([b"\x82\xa4type\xa7request\xa6job_id\xa2\xff\xfe"], ""),
        "array as a map key": ([b"\x81\x91\x01\x01"], ""),
        "array claims 4G items": ([b"\xdd\xff\xff\xff\xff"], ""),
        "string claims 4 GiB": ([b"\xdb\xff\xff\xff\xff"], ""),
        "ext type": ([b"\xd4\x01\x00"], ""),
        "nested 200 deep": ([deep_request(200)], ""),
        "nested 1,000 deep (the issue's repro)": ([deep_request(1000)], ""),
        "maps nested 100,000 deep": ([b"\x82\xa4type\xa7request\xa4body" + nested(100_000, b"\x81\xa1a")], ""),
        "deep in an unknown field": ([b"\x85\xa4type\xa7request\xa6job_id\xa2df\xa3url\xa1/\xa4body\x80"
                                      b"\xa4junk" + nested(5000)], ""),
    }


def internal_kinds(valid: bytes) -> dict[str, list[bytes]]:
    """Every kind of malformed message for an internal socket (array-like tagged Structs), `valid` being the
    encoding of one message the socket does take."""
    pack = msgspec.msgpack.encode
    return {
        "never-used byte": [b"\xc1"],
        "truncated": [valid[:-1]],
        "empty frame": [b""],
        "too many frames": [valid, valid],
        "unknown tag": [pack(["Launch", 1, 2])],
        "wrong type": [pack({"a": 1})],
        "nil": [pack(None)],
        "nested 1,000 deep": [nested(1000)],
        "nested 1,000,000 deep": [nested(1_000_000)],
        "tag then deep": [b"\x92" + pack("Submit") + nested(5000)],
        "array claims 4G items": [b"\xdd\xff\xff\xff\xff"],
    }


def mutated(frames: list[bytes]) -> st.SearchStrategy[list[bytes]]:
    """Byte-level damage to one message: truncation, a flipped byte, bytes inserted."""
    frame = frames[0]
    cut = st.integers(0, max(len(frame) - 1, 0)).map(lambda i: [frame[:i]])
    flip = st.tuples(st.integers(0, max(len(frame) - 1, 0)), st.integers(0, 255)).map(
        lambda t: [frame[:t[0]] + bytes([t[1]]) + frame[t[0] + 1:]])
    insert = st.tuples(st.integers(0, len(frame)), st.binary(min_size=1, max_size=8)).map(
        lambda t: [frame[:t[0]] + t[1] + frame[t[0]:]])
    return st.one_of(cut, flip, insert)


def malformed_batch_frames(key: str = "") -> st.SearchStrategy[list[bytes]]:
    """Any of the kinds above, random bytes and frame counts, or damage to a valid job. Each gets one answer."""
    kinds = [frames for frames, _ in batch_kinds(key).values()]
    return st.one_of(st.sampled_from(kinds), st.lists(st.binary(max_size=32), min_size=1, max_size=4),
                     mutated([batch_job("m", key)]),
                     st.integers(1, 3000).map(lambda depth: [deep_request(depth)]))


# ---- a raw ZMTP 3.0 peer -----------------------------------------------------------------------------------------

_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def _ready(socket_type: bytes) -> bytes:
    body = bytes([5]) + b"READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return bytes([0x04, len(body)]) + body


async def send_frame_of(endpoint: str, size: int, chunk: int = 1 << 20, wait: float = 30.0) -> tuple[int, bool]:
    """Connect to a tcp:// ZeroMQ endpoint as a DEALER (ZMTP 3.0, NULL security) and send one frame of `size`
    zero bytes, streamed from one reused `chunk`-byte buffer (so this process never holds the frame).

    Returns (how many of the frame's bytes were written before the peer hung up, whether it hung up within
    `wait` seconds of the last byte written).
    """
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    sent = 0
    try:
        writer.write(_GREETING + _ready(b"DEALER"))
        await writer.drain()
        await reader.readexactly(64)  # the peer's greeting
        head = await reader.readexactly(2)  # its READY command
        await reader.readexactly(head[1])
        writer.write(bytes([0x02]) + struct.pack(">Q", size))  # a long, final frame
        buffer = bytes(chunk)
        while sent < size and not writer.transport.is_closing():
            part = min(chunk, size - sent)
            writer.write(buffer if part == chunk else buffer[:part])
            await writer.drain()
            sent += part
        async with asyncio.timeout(wait):
            while await reader.read(1 << 16):  # whatever it answers, until it hangs up
                pass
        return sent, True
    except (ConnectionError, asyncio.IncompleteReadError):
        return sent, True
    except TimeoutError:
        return sent, False
    finally:
        writer.close()
