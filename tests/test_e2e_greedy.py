"""Acceptance: greedy output over HTTP equals transformers' generate, token for token, in three configurations."""

import asyncio

import aiohttp
import pytest

from tests.conftest import hf_greedy, hf_tokenizer
from tests.prompts import MAX_TOKENS, story_prompts
from tests.server import ShuttleServer

CONFIGS = {
    "defaults": (),
    "chunked-prefill": ("--max-num-batched-tokens", "16"),
    "max-num-seqs-3": ("--max-num-seqs", "3"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def configured_server(request):
    srv = ShuttleServer(*CONFIGS[request.param])
    yield srv
    srv.stop()


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_concurrent_greedy_matches_transformers(configured_server):
    prompts = story_prompts()
    tokenizer = hf_tokenizer()
    prompt_ids = [tokenizer(p).input_ids for p in prompts]
    lengths = [len(ids) for ids in prompt_ids]
    assert min(lengths) == 1 and max(lengths) <= 300 and len(set(lengths)) == 16
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(complete(session, configured_server.url, p, m)
                                         for p, m in zip(prompts, MAX_TOKENS)))
    for ids, max_tokens, result in zip(prompt_ids, MAX_TOKENS, results):
        choice = result["choices"][0]
        expected = hf_greedy(ids, max_tokens)
        assert choice["prompt_token_ids"] == ids
        assert choice["token_ids"] == expected, f"prompt of {len(ids)} tokens"
        assert choice["finish_reason"] == ("length" if len(expected) == max_tokens and expected[-1] not in (1, 2)
                                           else "stop")
        usage = result["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            len(ids), len(expected), len(ids) + len(expected))
        # The prompts share prefixes, so how much was cached depends on timing; never the whole prompt.
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < len(ids)
        prefix_text = tokenizer.decode(ids, skip_special_tokens=True)
        assert prefix_text + choice["text"] == tokenizer.decode(ids + expected, skip_special_tokens=True)
