"""Acceptance: streamed text (SSE and WebSocket) equals the non-streamed text; finish_reason and usage exact."""

import aiohttp
import pytest

from tests.client import post_completion, stream_completion
from tests.conftest import hf_greedy, hf_tokenizer

PROMPT = "Once upon a time, there was a little dog"


@pytest.fixture(scope="module")
def reference():
    ids = hf_tokenizer()(PROMPT).input_ids
    return ids, {m: hf_greedy(ids, m) for m in (60, 400)}


@pytest.mark.parametrize("max_tokens", [60, 400])
async def test_sse_equals_non_streamed(server, reference, max_tokens):
    ids, expected = reference[0], reference[1][max_tokens]
    finish = "stop" if expected[-1] in (1, 2) else "length"
    async with aiohttp.ClientSession() as session:
        status, full = await post_completion(session, server.url, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
        events = await stream_completion(session, server.url, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                         stream_options={"include_usage": True}, return_token_ids=True)
    assert status == 200
    choice = full["choices"][0]
    assert choice["finish_reason"] == finish
    usage = {"prompt_tokens": len(ids), "completion_tokens": len(expected), "total_tokens": len(ids) + len(expected)}
    assert {k: full["usage"][k] for k in usage} == usage

    *chunks, usage_chunk = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [finish]
    assert len({c["id"] for c in events}) == 1 and all(c["object"] == "text_completion" for c in events)
    assert usage_chunk["choices"] == [] and {k: usage_chunk["usage"][k] for k in usage} == usage
    # Token by token: every chunk carries the ids it adds, and together they are transformers' greedy ids.
    streamed_ids = [c["choices"][0]["token_ids"] for c in chunks]
    assert all(streamed_ids) and [t for ids_ in streamed_ids for t in ids_] == expected


async def test_websocket_equals_non_streamed(server, reference):
    ids, expected = reference[0], reference[1][60]
    async with aiohttp.ClientSession() as session:
        _, full = await post_completion(session, server.url, prompt=PROMPT, max_tokens=60, temperature=0)
        async with session.ws_connect(f"{server.url}/v1/ws") as ws:
            await ws.send_json({"type": "generate", "id": "a", "prompt": PROMPT, "max_tokens": 60, "temperature": 0})
            messages = []
            while not messages or messages[-1]["type"] not in ("done", "error"):
                messages.append(await ws.receive_json(timeout=30))
    *deltas, done = messages
    assert done == {"type": "done", "id": "a", "finish_reason": "length",
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": 60, "total_tokens": len(ids) + 60,
                              "prompt_tokens_details": done["usage"]["prompt_tokens_details"]}}
    assert all(d["type"] == "delta" and d["id"] == "a" for d in deltas)
    assert "".join(d["text"] for d in deltas) == full["choices"][0]["text"]
    assert [t for d in deltas for t in d["token_ids"]] == expected


async def test_websocket_reports_bad_frames_and_keeps_going(server):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{server.url}/v1/ws") as ws:
            await ws.send_str("{not json")
            assert (await ws.receive_json(timeout=10))["error"]["code"] == 400
            await ws.send_json({"type": "generate", "id": "x", "max_tokens": 5})
            bad = await ws.receive_json(timeout=10)
            assert bad["type"] == "error" and bad["id"] == "x" and bad["error"]["param"] == "prompt"
            await ws.send_json({"type": "generate", "id": "y", "prompt": "Hi", "max_tokens": 3, "temperature": 0})
            while (msg := await ws.receive_json(timeout=30))["type"] == "delta":
                pass
            assert msg["type"] == "done" and msg["usage"]["completion_tokens"] <= 3
