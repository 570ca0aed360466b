"""Acceptance: greedy output over HTTP equals transformers' generate, token for token, in two configurations."""

import asyncio

import aiohttp
import pytest
from transformers import AutoTokenizer

from shuttle.capacity.story_prompts import MAX_TOKENS, story_prompts
from tests.conftest import CHAT_TEMPLATE, hf_greedy, hf_tokenizer
from tests.hf_cache import REPO_ID
from tests.server import MODEL_DIR, REPO

BLOCK_SIZE = 16  # the servers' default --block-size


@pytest.fixture(params=["server", "chunked_server"])
def configured_server(request, server, chunked_server):
    """The suite's default server, then one with 16-token prefill chunks, 3 running sequences and no prefix cache
    (both named as fixtures, so that conftest puts these tests with the other users of the shared servers)."""
    return {"server": server, "chunked_server": chunked_server}[request.param], request.param == "server"


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_concurrent_greedy_matches_transformers(configured_server):
    srv, caching = configured_server
    prompts = story_prompts()
    tokenizer = hf_tokenizer()
    prompt_ids = [tokenizer(p).input_ids for p in prompts]
    lengths = [len(ids) for ids in prompt_ids]
    assert min(lengths) == 1 and max(lengths) <= 300 and len(set(lengths)) == 16
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(complete(session, srv.url, p, m)
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
        # The prompts share prefixes, so how much was cached depends on timing: whole blocks, never the last token.
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached % BLOCK_SIZE == 0 and cached <= (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        if not caching:
            assert cached == 0
        prefix_text = tokenizer.decode(ids, skip_special_tokens=True)
        assert prefix_text + choice["text"] == tokenizer.decode(ids + expected, skip_special_tokens=True)
    if caching:  # every prompt was just computed, so a repeat of the longest is served from its full blocks
        longest = max(range(len(prompts)), key=lambda i: lengths[i])
        async with aiohttp.ClientSession() as session:
            again = await complete(session, srv.url, prompts[longest], MAX_TOKENS[longest])
        full_blocks = (lengths[longest] - 1) // BLOCK_SIZE
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * BLOCK_SIZE
        assert again["choices"][0]["token_ids"] == results[longest]["choices"][0]["token_ids"]


async def test_a_server_started_by_hugging_face_id_serves_it_by_that_id(chunked_server):
    """`chunked_server` was started as `shuttle serve org/tiny-model` offline (its greedy output is checked above):
    the id is what /v1/models lists and what requests name, and a client's tokenizer lookup by it succeeds."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{chunked_server.url}/v1/models") as response:
            # root: the model as given, as vLLM reports it (it was the resolved cache directory)
            assert [(m["id"], m["root"]) for m in (await response.json())["data"]] == [(REPO_ID, REPO_ID)]
        body = {"model": REPO_ID, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}
        async with session.post(f"{chunked_server.url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            result = await response.json()
    assert result["model"] == REPO_ID
    # guidellm's default: the tokenizer loaded by the served model id (here from the server's cache, offline)
    tokenizer = AutoTokenizer.from_pretrained(REPO_ID, cache_dir=str(chunked_server.hf_home / "hub"),
                                              local_files_only=True)
    ids = tokenizer("Once upon a time").input_ids
    assert result["choices"][0]["token_ids"] == hf_greedy(ids, 8)


async def test_offline_llm_equals_the_server_token_for_token(server):
    """Acceptance (issue 43): `LLM(model).generate` on the server's model, with the server's flags (its chat template;
    a smaller KV cache, which changes no output), gives its greedy completions token for token and text for text, and
    `LLM.chat` its chat replies: the same scheduler, model runner and detokenizer, in this process."""
    from shuttle import LLM, SamplingParams

    prompts = story_prompts()
    conversations = [[{"role": "user", "content": p}] for p in prompts[1:6]]
    async with aiohttp.ClientSession() as session:
        completions = await asyncio.gather(*(complete(session, server.url, p, m)
                                             for p, m in zip(prompts, MAX_TOKENS)))

        async def chat(messages: list) -> dict:
            body = {"messages": messages, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
            async with session.post(f"{server.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                return await response.json()

        chats = await asyncio.gather(*(chat(c) for c in conversations))

    def offline():
        llm = LLM(str(MODEL_DIR), chat_template=str(REPO / CHAT_TEMPLATE), kv_cache_memory="256MiB")
        greedy = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
        return (llm.generate(prompts, greedy, use_tqdm=False),
                llm.chat(conversations, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False))

    generated, replies = await asyncio.to_thread(offline)
    for output, result in zip(generated, completions):
        choice = result["choices"][0]
        assert output.prompt_token_ids == choice["prompt_token_ids"]
        assert output.outputs[0].token_ids == choice["token_ids"]
        assert (output.outputs[0].text, output.outputs[0].finish_reason) == (choice["text"], choice["finish_reason"])
    for output, result in zip(replies, chats):
        choice = result["choices"][0]
        assert output.prompt_token_ids == result["prompt_token_ids"]
        assert output.outputs[0].token_ids == choice["token_ids"]
        assert (output.outputs[0].text, output.outputs[0].finish_reason) == (choice["message"]["content"],
                                                                             choice["finish_reason"])
