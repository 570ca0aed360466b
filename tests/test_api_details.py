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
