"""Issue 4 acceptance 6: a table of bad requests, each with its documented status and an OpenAI error body;
none gives a 5xx, and the server serves normally afterwards.

In-process (issue 9): the real frontend app on a loopback port with a scripted fake engine, since every case
is decided before the engine is asked."""

import json

import aiohttp
import pytest

from tests.client import health, post_completion
from tests.inprocess import start_app

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "Hi", "max_tokens": 3}
MSG = [{"role": "user", "content": "Hi"}]


def nested(depth: int) -> bytes:
    return ('{"prompt": ' + "[" * depth + "]" * depth + "}").encode()


# (name, path, body: dict | bytes, headers, status, param)  param None = not checked
CASES = [
    ("invalid json", C, b"{not json", None, 400, None),
    ("array body", C, b"[1, 2]", None, 400, None),
    ("deeply nested", C, nested(100_000), None, 400, None),
    ("missing prompt", C, {"max_tokens": 3}, None, 400, "prompt"),
    ("prompt number", C, {"prompt": 5}, None, 400, "prompt"),
    ("prompt empty list", C, {"prompt": []}, None, 400, "prompt"),
    ("prompt id out of vocab", C, {"prompt": [1, 512]}, None, 400, "prompt"),
    ("prompt mixed list", C, {"prompt": ["a", 3]}, None, 400, "prompt"),
    ("prompt too long", C, {"prompt": "the dog ran " * 400}, None, 400, "prompt"),
    ("max_tokens negative", C, {**OK, "max_tokens": -1}, None, 400, "max_tokens"),
    ("max_tokens string", C, {**OK, "max_tokens": "5"}, None, 400, "max_tokens"),
    ("max_tokens too large", C, {**OK, "max_tokens": 600}, None, 400, "max_tokens"),
    ("temperature negative", C, {**OK, "temperature": -0.5}, None, 400, "temperature"),
    ("temperature string", C, {**OK, "temperature": "hot"}, None, 400, "temperature"),
    ("top_p zero", C, {**OK, "top_p": 0}, None, 400, "top_p"),
    ("top_p above one", C, {**OK, "top_p": 1.5}, None, 400, "top_p"),
    ("top_k below -1", C, {**OK, "top_k": -2}, None, 400, "top_k"),
    ("top_k huge", C, {**OK, "top_k": 2**64}, None, 400, "top_k"),
    ("min_p above one", C, {**OK, "min_p": 2}, None, 400, "min_p"),
    ("n zero", C, {**OK, "n": 0}, None, 400, "n"),
    ("n too large", C, {**OK, "n": 100}, None, 400, "n"),
    ("presence_penalty out of range", C, {**OK, "presence_penalty": 3}, None, 400, "presence_penalty"),
    ("frequency_penalty out of range", C, {**OK, "frequency_penalty": -3}, None, 400, "frequency_penalty"),
    ("repetition_penalty zero", C, {**OK, "repetition_penalty": 0}, None, 400, "repetition_penalty"),
    ("logit_bias key not an id", C, {**OK, "logit_bias": {"dog": 1}}, None, 400, "logit_bias"),
    ("logit_bias key not canonical", C, {**OK, "logit_bias": {"01": 1}}, None, 400, "logit_bias"),
    ("stream_options without stream", C, {**OK, "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
    ("prompt of megabytes", C, {"prompt": "ab " * 1_300_000}, None, 400, "prompt"),
    ("chat prompt too long", CHAT, {"messages": [{"role": "user", "content": "the dog ran " * 400}]}, None, 400,
     "messages"),
    ("chat message without role", CHAT, {"messages": [{"content": "Hi"}]}, None, 400, "messages"),
    ("logit_bias value out of range", C, {**OK, "logit_bias": {"5": 1000}}, None, 400, "logit_bias"),
    ("stop number", C, {**OK, "stop": 5}, None, 400, "stop"),
    ("stop empty string", C, {**OK, "stop": [""]}, None, 400, "stop"),
    ("stop too many", C, {**OK, "stop": [str(i) for i in range(20)]}, None, 400, "stop"),
    ("stop_token_ids out of vocab", C, {**OK, "stop_token_ids": [9999]}, None, 400, "stop_token_ids"),
    ("min_tokens above max_tokens", C, {**OK, "min_tokens": 10}, None, 400, "min_tokens"),
    ("logprobs too many", C, {**OK, "logprobs": 50}, None, 400, "logprobs"),
    ("echo with logprobs too many", C, {**OK, "echo": True, "logprobs": 21}, None, 400, "logprobs"),
    ("seed too large", C, {**OK, "seed": 2**70}, None, 400, "seed"),
    ("priority huge", C, {**OK, "priority": 2**40}, None, 400, "priority"),
    ("stream not bool", C, {**OK, "stream": "yes"}, None, 400, "stream"),
    ("timeout negative", C, {**OK, "timeout": -1}, None, 400, "timeout"),
    ("unknown model", C, {**OK, "model": "gpt-4"}, None, 404, "model"),
    ("chat empty messages", CHAT, {"messages": []}, None, 400, "messages"),
    ("chat missing messages", CHAT, {"max_tokens": 3}, None, 400, "messages"),
    ("chat empty role", CHAT, {"messages": [{"role": "", "content": "Hi"}]}, None, 400, "messages"),
    ("chat messages not a list", CHAT, {"messages": "Hi"}, None, 400, "messages"),
    ("chat image content", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
     "messages"),
    ("chat top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, None, 400, "top_logprobs"),
    ("chat tools", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, None, 400, "tools"),
    ("chat max_completion_tokens negative", CHAT, {"messages": MSG, "max_completion_tokens": -3}, None, 400,
     "max_completion_tokens"),
    ("chat max_completion_tokens too large", CHAT, {"messages": MSG, "max_completion_tokens": 600}, None, 400,
     "max_completion_tokens"),
    ("wrong content type", C, json.dumps(OK).encode(), {"Content-Type": "text/plain"}, 415, None),
    ("oversized body", C, b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}', None, 413, None),
    ("unknown route", "/v1/engines", OK, None, 404, None),
]


@pytest.fixture(scope="module")
async def chat_server():
    app = await start_app()  # with tests/data/stories_chat.jinja as its chat template
    yield app
    await app.close()


@pytest.mark.parametrize("name, path, body, headers, status, param", CASES, ids=[c[0] for c in CASES])
async def test_bad_request(chat_server, name, path, body, headers, status, param):
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = headers or {"Content-Type": "application/json"}
        async with session.post(f"{chat_server.url}{path}", data=data, headers=headers) as response:
            assert response.status == status, await response.text()
            text = await response.text()
    assert "Traceback" not in text
    error = json.loads(text)["error"]
    assert isinstance(error["message"], str) and error["message"] and error["code"] == status
    assert error["type"] and set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error


async def test_wrong_method_and_still_serving(chat_server):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{chat_server.url}/v1/completions") as response:
            assert response.status == 405 and "POST" in response.headers["Allow"]
            assert (await response.json())["error"]["code"] == 405
        status, body = await post_completion(session, chat_server.url, prompt="Hi", max_tokens=3, temperature=0)
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        stats = await health(session, chat_server.url)
        assert stats["status"] == "ok"
