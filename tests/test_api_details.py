"""Issue 8, the API items: each checked in process (the real aiohttp application over a scripted engine), with the
official `openai` client where it applies."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from frontend.tokenizer import TextTokenizer
from tests.fake_engine import SERVED, TEMPLATES, FakeEngine, frontend_app, sampled_logprob
from tests.server import MODEL_DIR

TOK = TextTokenizer(str(MODEL_DIR))
PROMPT = "Once upon a time"
PROMPT_IDS = [1, 403, 407, 261, 378]
# ' there', ' was', ' a', ' little', ' g', 'ir', 'l', ' named', ' Lily', '.', ' She', ' had', ' a', ' g', 'ir', 'l',
# ' do', 'll', '.'  ("girl" is spelled " g" + "ir" + "l", twice)
STORY = TOK.encode("there was a little girl named Lily. She had a girl doll.")[1:]
STORY_TEXT = " there was a little girl named Lily. She had a girl doll."
USER = [{"role": "user", "content": "Tom had a ball."}]


@asynccontextmanager
async def served(engine: FakeEngine | None = None, **kwargs):
    """An in-process server on a real loopback port; yields (aiohttp test client, engine)."""
    engine = engine or FakeEngine(script=list(STORY))
    async with TestClient(TestServer(frontend_app(engine, **kwargs))) as client:
        yield client, engine


def openai_client(client: TestClient, api_key: str = "unused", **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=api_key, **kwargs)


async def post(client: TestClient, path: str, body: dict, **kwargs) -> tuple[int, dict]:
    async with client.post(path, json=body, **kwargs) as response:
        return response.status, await response.json()


async def stream(client: TestClient, path: str, body: dict) -> list[dict]:
    """The `data:` events of a streamed request, checking it ends with [DONE]."""
    async with client.post(path, json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        events = [line.decode().strip()[len("data: "):] async for line in response.content
                  if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def plain_text_ids(text: str) -> list[int]:
    """`text` tokenized with every special token's text read as ordinary characters."""
    plain = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    plain.encode_special_tokens = True
    return plain.encode(text, add_special_tokens=False).ids


# ---- 1. an explicit null means the default -----------------------------------------------------------------------

COMPLETION_NULLS = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stream",
                    "stream_options", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                    "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                    "priority", "timeout", "return_token_ids", "user", "logprobs", "echo", "best_of", "suffix",
                    "add_special_tokens"]
CHAT_NULLS = [name for name in COMPLETION_NULLS if name not in ("logprobs", "echo", "best_of", "suffix")] + [
    "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "parse_special_tokens_in_content"]


async def test_explicit_null_is_the_default_for_every_optional_field():
    async with served() as (client, engine):
        for path, base, nulls in (("/v1/completions", {"prompt": PROMPT}, COMPLETION_NULLS),
                                  ("/v1/chat/completions", {"messages": USER}, CHAT_NULLS)):
            status, plain = await post(client, path, base)
            assert status == 200, plain
            status, nulled = await post(client, path, {**base, **dict.fromkeys(nulls)})
            assert status == 200, nulled
            assert engine.submitted[-1].sampling == engine.submitted[-2].sampling
            assert engine.submitted[-1].prompt_token_ids == engine.submitted[-2].prompt_token_ids
            assert nulled["choices"] == plain["choices"]
        status, tokens = await post(client, "/tokenize", {"prompt": PROMPT, "add_special_tokens": None, "model": None})
        assert (status, tokens["tokens"]) == (200, PROMPT_IDS)


async def test_official_client_with_none_parameters():
    async with served() as (client, engine):
        api = openai_client(client, max_retries=0)
        result = await api.completions.create(model=SERVED, prompt=PROMPT, max_tokens=None, temperature=None,
                                              top_p=None, n=None, presence_penalty=None, frequency_penalty=None,
                                              echo=None, logprobs=None, seed=None, stop=None, user=None)
        assert result.choices[0].text == STORY_TEXT
        chat = await api.chat.completions.create(model=SERVED, messages=USER, temperature=None, top_p=None,
                                                 logprobs=None, top_logprobs=None, max_tokens=None, n=None)
        assert chat.choices[0].message.content == STORY_TEXT
        assert [s.sampling.temperature for s in engine.submitted] == [1.0, 1.0]


# ---- 4. GET /v1/models/{id} --------------------------------------------------------------------------------------

async def test_models_retrieve():
    async with served() as (client, _):
        api = openai_client(client, max_retries=0)
        model = await api.models.retrieve(SERVED)
        assert (model.id, model.object, model.owned_by) == (SERVED, "model", "shuttle")
        assert model.model_extra["max_model_len"] == 512
        assert [m.id for m in (await api.models.list()).data] == [SERVED]
        with pytest.raises(openai.NotFoundError) as raised:
            await api.models.retrieve("gpt-4")
        assert raised.value.body["code"] == 404 and "gpt-4" in raised.value.body["message"]


# ---- 5. the Authorization scheme is case-insensitive, the key is not ----------------------------------------------

@pytest.mark.parametrize("header, status", [
    ("Bearer Secret-Key", 200), ("bearer Secret-Key", 200), ("BEARER Secret-Key", 200), ("bEaReR  Secret-Key", 200),
    ("Bearer secret-key", 401), ("Bearer Secret-Key2", 401), ("Basic Secret-Key", 401), ("Secret-Key", 401),
    ("Bearer", 401), ("", 401),
])
async def test_authorization_scheme_case(header, status):
    async with served(api_key="Secret-Key") as (client, _):
        async with client.get("/v1/models", headers={"Authorization": header} if header else {}) as response:
            assert response.status == status, await response.text()


async def test_official_client_authenticates():
    async with served(api_key="Secret-Key") as (client, _):
        assert (await openai_client(client, "Secret-Key").models.retrieve(SERVED)).id == SERVED
        with pytest.raises(openai.AuthenticationError):
            await openai_client(client, "secret-key", max_retries=0).models.retrieve(SERVED)


# ---- 6. top logprobs always list the sampled token ---------------------------------------------------------------

def text_of(token_id: int) -> str:
    return TOK.token_text(token_id)[0]


async def test_logprobs_zero_lists_the_sampled_token():
    async with served(FakeEngine(script=STORY[:4])) as (client, _):
        status, result = await post(client, "/v1/completions", {"prompt": PROMPT, "logprobs": 0})
        lp = result["choices"][0]["logprobs"]
        logprob = [sampled_logprob(0), -2.5, -0.1, sampled_logprob(3)]  # " was" and " a" are among the fake's top
        assert lp["token_logprobs"] == logprob
        assert lp["top_logprobs"] == [{text_of(t): v} for t, v in zip(STORY[:4], logprob)]
        status, chat = await post(client, "/v1/chat/completions", {"messages": USER, "logprobs": True,
                                                                   "top_logprobs": 0})
        content = chat["choices"][0]["logprobs"]["content"]
        assert [[(e["token"], e["logprob"]) for e in c["top_logprobs"]] for c in content] == [
            [(text_of(t), v)] for t, v in zip(STORY[:4], logprob)]


async def test_top_logprobs_add_the_sampled_token_when_it_is_not_among_them():
    async with served(FakeEngine(script=STORY[:4])) as (client, _):
        status, result = await post(client, "/v1/completions", {"prompt": PROMPT, "logprobs": 2})
        tops = result["choices"][0]["logprobs"]["top_logprobs"]
        assert tops[0] == {" a": -0.1, " was": -2.5, " there": sampled_logprob(0)}  # k + 1 entries
        assert tops[2] == {" a": -0.1, " was": -2.5}  # the sampled " a" is the most likely
        status, chat = await post(client, "/v1/chat/completions", {"messages": USER, "logprobs": True,
                                                                   "top_logprobs": 2})
        content = chat["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content[0]["top_logprobs"]] == [" a", " was", " there"]
        assert [e["token"] for e in content[2]["top_logprobs"]] == [" a", " was"]


# ---- 11. x-request-id, CORS, timeouts not retried ----------------------------------------------------------------

async def test_x_request_id_header():
    async with served() as (client, _):
        async with client.post("/v1/completions", json={"prompt": PROMPT}) as response:
            assert response.headers["x-request-id"] == (await response.json())["id"]
        async with client.post("/v1/chat/completions", json={"messages": USER, "stream": True}) as response:
            body = await response.text()
            first = json.loads(body.split("\n")[0][len("data: "):])
            assert response.headers["x-request-id"] == first["id"]
        for method, path, body in (("POST", "/v1/completions", {"prompt": PROMPT}), ("GET", "/v1/models", None),
                                   ("POST", "/v1/completions", {"prompt": 5}), ("GET", "/nowhere", None),
                                   ("GET", "/health", None)):
            async with client.request(method, path, json=body, headers={"X-Request-Id": "client-id-7"}) as response:
                assert response.headers["x-request-id"] == "client-id-7", path
        async with client.get("/v1/models") as response:
            assert len(response.headers["x-request-id"]) >= 16  # one is made up when there is nothing to echo


async def test_cors_off_by_default():
    async with served() as (client, _):
        async with client.options("/v1/completions", headers={"Origin": "http://app.example",
                                                              "Access-Control-Request-Method": "POST"}) as response:
            assert "Access-Control-Allow-Origin" not in response.headers
        async with client.post("/v1/completions", json={"prompt": PROMPT},
                               headers={"Origin": "http://app.example"}) as response:
            assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers


async def test_cors_for_allowed_origins():
    origin = "http://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    async with served(api_key="Secret-Key", allowed_origins=(origin,)) as (client, _):
        async with client.options("/v1/chat/completions", headers=preflight) as response:
            assert response.status == 204  # no key needed: browsers never send one with a preflight
            assert response.headers["Access-Control-Allow-Origin"] == origin
            assert "POST" in response.headers["Access-Control-Allow-Methods"]
            allowed = {h.strip().lower() for h in response.headers["Access-Control-Allow-Headers"].split(",")}
            assert {"authorization", "content-type", "x-stainless-os"} <= allowed
            assert "Origin" in response.headers["Vary"]
        async with client.post("/v1/completions", json={"prompt": PROMPT},
                               headers={"Origin": origin, "Authorization": "Bearer Secret-Key"}) as response:
            assert response.status == 200 and response.headers["Access-Control-Allow-Origin"] == origin
            assert "x-request-id" in response.headers["Access-Control-Expose-Headers"].lower()
        async with client.post("/v1/completions", json={"prompt": PROMPT}, headers={"Origin": origin}) as response:
            assert response.status == 401 and response.headers["Access-Control-Allow-Origin"] == origin
        async with client.options("/v1/completions", headers={**preflight, "Origin": "http://evil.example"}) as response:
            assert "Access-Control-Allow-Origin" not in response.headers
    async with served(allowed_origins=("*",)) as (client, _):
        async with client.options("/v1/completions", headers={**preflight, "Origin": "http://any.example"}) as response:
            assert response.status == 204 and response.headers["Access-Control-Allow-Origin"] == "*"


async def test_timeout_is_not_retried_by_the_official_client():
    engine = FakeEngine(error=(408, "the request timed out"))
    async with served(engine) as (client, _):
        with pytest.raises(openai.APIStatusError) as raised:
            await openai_client(client, max_retries=2).completions.create(model=SERVED, prompt=PROMPT)
        assert raised.value.status_code == 408 and raised.value.response.headers["x-should-retry"] == "false"
        assert len(engine.submitted) == 1
