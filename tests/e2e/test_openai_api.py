"""Issue 4 acceptance: the official `openai` client, n, seeds, stop strings, UTF-8, logprobs, usage, auth."""

import asyncio

import openai
import pytest
import torch

from tests.byte_runs import streamed_text
from tests.conftest import API_KEY, hf_greedy, hf_model, hf_tokenizer


@pytest.fixture(scope="module")
def client(keyed_server):
    return openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
async def aclient(keyed_server):
    async with openai.AsyncOpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0) as api:
        yield api


PROMPT = "Once upon a time"


def assert_usage(usage, prompt_tokens, completion_tokens):
    assert isinstance(usage, openai.types.CompletionUsage)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


# ---- 1. the official client, sync and async, streaming and not ---------------------------------------------------

def test_sync_completion_and_stream(client):
    result = client.completions.create(model="stories", prompt=PROMPT, max_tokens=20, temperature=0)
    assert result.object == "text_completion" and result.id.startswith("cmpl-") and isinstance(result.created, int)
    assert result.model == "stories"
    [choice] = result.choices
    assert choice.index == 0 and isinstance(choice.text, str)
    prompt_ids = hf_tokenizer()(PROMPT)["input_ids"]
    expected = hf_greedy(prompt_ids, 20)  # transformers stops at EOS too (counted, as shuttle counts it)
    assert choice.finish_reason == ("stop" if expected[-1] in (1, 2) else "length")
    assert_usage(result.usage, len(prompt_ids), len(expected))
    chunks = list(client.completions.create(model="stories", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == result.usage.completion_tokens


def test_sync_chat_and_stream(client):
    messages = [{"role": "user", "content": PROMPT}]
    result = client.chat.completions.create(model="stories", messages=messages, max_tokens=20, temperature=0)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    [choice] = result.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model="stories", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


async def test_async_completion_and_chat(aclient):
    result = await aclient.completions.create(model="stories", prompt=PROMPT, max_tokens=12, temperature=0)
    stream = await aclient.completions.create(model="stories", prompt=PROMPT, max_tokens=12, temperature=0,
                                              stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == result.choices[0].text
    chat = await aclient.chat.completions.create(model="stories", messages=[{"role": "user", "content": PROMPT}],
                                                 max_completion_tokens=12, temperature=0)
    stream = await aclient.chat.completions.create(model="stories", messages=[{"role": "user", "content": PROMPT}],
                                                   max_completion_tokens=12, temperature=0, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == chat.choices[0].message.content


def test_auth_model_name_and_models_list(keyed_server, client):
    bad = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="stories", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    [model] = client.models.list().data
    assert model.id == "stories" and model.model_extra["max_model_len"] == 512


# ---- 2. n ---------------------------------------------------------------------------------------------------------

def test_greedy_n3_gives_three_identical_choices_equal_to_transformers(client):
    result = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0, n=3,
                                       extra_body={"return_token_ids": True})
    expected = hf_greedy(hf_tokenizer()(PROMPT).input_ids, 40)
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert all(c.model_extra["token_ids"] == expected for c in result.choices)
    assert_usage(result.usage, 5, 3 * len(expected))


async def test_seeded_n3_is_reproducible_across_runs_and_batches(aclient):
    async def seeded():
        result = await aclient.completions.create(model="stories", prompt=PROMPT, max_tokens=30, temperature=1.0,
                                                  n=3, seed=7)
        return [c.text for c in sorted(result.choices, key=lambda c: c.index)]

    alone = await seeded()
    noise = [aclient.completions.create(model="stories", prompt=f"Tom had {i} apples", max_tokens=40,
                                        temperature=0.8) for i in range(10)]
    crowded, *_ = await asyncio.gather(seeded(), *noise)
    assert alone == await seeded() == crowded
    assert len(set(alone)) > 1  # the three choices are different samples


# ---- 3. stop strings ----------------------------------------------------------------------------------------------

def test_stop_string_spanning_tokens_ends_output_before_it(client):
    full = client.completions.create(model="stories", prompt=PROMPT, max_tokens=60, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
    pieces = [hf_tokenizer().convert_ids_to_tokens(t) for t in full.model_extra["token_ids"]]
    assert "▁g" in pieces and "ir" in pieces  # "girl" is spelled over several tokens
    stop = "girl"
    expected = full.text[:full.text.index(stop)]
    result = client.completions.create(model="stories", prompt=PROMPT, max_tokens=60, temperature=0, stop=[stop])
    assert result.choices[0].text == expected and result.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="stories", prompt=PROMPT, max_tokens=60, temperature=0,
                                            stop=stop, stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == expected and chunks[-1].choices[0].finish_reason == "stop"
    assert not any(t.endswith(("g", "gi", "gir")) and i == len(texts) - 1 for i, t in enumerate(texts))
    chat = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=60, temperature=0, stop=stop)
    assert stop not in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"


# ---- 4. UTF-8 -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, extra", [
    ("Lily saw a 🐶 and said héllo 你好", {"temperature": 0}),
    ("The cat said", {"temperature": 5.0, "top_k": 3, "seed": 3, "logit_bias": None}),
])
def test_multibyte_text_streams_without_broken_characters(client, prompt, extra):
    tokenizer = hf_tokenizer()
    extra = dict(extra)
    if "logit_bias" in extra:  # force the two byte tokens of "é" and " Once" at random: runs of byte tokens
        byte_ids = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "é".encode()]
        extra = {**extra, "logit_bias": {str(byte_ids[0]): 100.0, str(byte_ids[1]): 100.0, "403": 90.0}}
    passthrough = {k: extra.pop(k) for k in ("top_k", "logit_bias") if k in extra}
    body = dict(model="stories", prompt=prompt, max_tokens=60, **extra,
                extra_body={"return_token_ids": True, **passthrough})
    full = client.completions.create(**body).choices[0]
    chunks = [c.choices[0].text for c in client.completions.create(**body, stream=True)]
    assert "".join(chunks) == full.text
    # The tokenizer's own decode of prompt + output, after the prompt's text (an invalid run of byte tokens is one
    # U+FFFD per byte, as its byte-fallback decoder makes it, but a character the run completes is out at once:
    # tests/byte_runs.py)
    prompt_ids, output_ids = full.model_extra["prompt_token_ids"], full.model_extra["token_ids"]

    def text(ids: list[int]) -> str:
        return streamed_text(ids, lambda i: tokenizer.decode(i, skip_special_tokens=True),
                             tokenizer.convert_ids_to_tokens, tokenizer.all_special_ids)
    shown, whole = text(prompt_ids), text(prompt_ids + output_ids)
    assert whole.startswith(shown)
    expected = whole[len(shown):]
    assert full.text == expected
    # U+FFFD only where the model really produced an invalid byte sequence, never from a split character
    assert sum(c.count("\ufffd") for c in chunks) == expected.count("\ufffd")
    # runs of byte tokens between words, some invalid (the valid ones: test_detokenizer)
    if "logit_bias" in passthrough:
        assert {*byte_ids, 403} <= set(output_ids) and "\ufffd" in full.text and " Once" in full.text


# ---- 5. logprobs --------------------------------------------------------------------------------------------------

def test_logprobs_match_transformers(client):
    result = client.completions.create(model="stories", prompt=PROMPT, max_tokens=25, temperature=0, logprobs=5,
                                       extra_body={"return_token_ids": True})
    choice = result.choices[0]
    prompt_ids = choice.model_extra["prompt_token_ids"]
    output_ids = choice.model_extra["token_ids"]
    with torch.inference_mode():
        logits = hf_model()(torch.tensor([prompt_ids + output_ids])).logits[0]
    reference = logits.log_softmax(-1)[len(prompt_ids) - 1:-1]  # position i predicts token i + 1
    got = torch.tensor(choice.logprobs.token_logprobs)
    want = reference[torch.arange(len(output_ids)), torch.tensor(output_ids)]
    assert torch.allclose(got, want, atol=1e-4)
    assert len(choice.logprobs.tokens) == len(output_ids)
    for top in choice.logprobs.top_logprobs:
        assert len(top) == 5 and list(top.values()) == sorted(top.values(), reverse=True)
    chat = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-6


# ---- 7. include_usage with n > 1 and echo --------------------------------------------------------------------------

def test_usage_is_exact_for_n_and_echo(client):
    chunks = list(client.completions.create(model="stories", prompt=[PROMPT, "Tom"], max_tokens=7, temperature=0.5,
                                            n=2, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    prompt_tokens = sum(len(hf_tokenizer()(p).input_ids) for p in (PROMPT, "Tom"))  # once per prompt, not per choice
    assert_usage(usage_chunk.usage, prompt_tokens, 4 * 7)
    assert sorted({c.choices[0].index for c in chunks[:-1]}) == [0, 1, 2, 3]
    echoed = client.completions.create(model="stories", prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text.startswith(PROMPT) and len(echoed.choices[0].text) > len(PROMPT)
    assert_usage(echoed.usage, 5, 5)


def test_prompt_forms(client):
    ids = hf_tokenizer()(PROMPT).input_ids
    texts = [client.completions.create(model="stories", prompt=p, max_tokens=8, temperature=0).choices
             for p in (PROMPT, ids, [PROMPT, PROMPT], [ids, ids])]
    assert texts[0][0].text == texts[1][0].text == texts[2][1].text == texts[3][0].text
    assert [c.index for c in texts[3]] == [0, 1]


async def test_tokenize_detokenize_and_open_health(keyed_server):
    import aiohttp
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{keyed_server.url}/health") as response:
            assert response.status == 200  # no key needed
        async with session.post(f"{keyed_server.url}/tokenize", json={"prompt": PROMPT}) as response:
            assert response.status == 401 and (await response.json())["error"]["code"] == 401
        async with session.post(f"{keyed_server.url}/tokenize", json={"prompt": PROMPT}, headers=auth) as response:
            tokens = await response.json()
        assert tokens == {"tokens": hf_tokenizer()(PROMPT).input_ids, "count": 5, "max_model_len": 512,
                          "token_strs": None}
        async with session.post(f"{keyed_server.url}/detokenize", json={"tokens": tokens["tokens"][1:]},
                                headers=auth) as response:
            assert (await response.json()) == {"prompt": PROMPT}
        async with session.post(f"{keyed_server.url}/tokenize", json={"messages": [{"role": "user",
                                                                                    "content": PROMPT}]},
                                headers=auth) as response:
            assert (await response.json())["tokens"][0] == 1  # the template's bos_token


def test_streamed_logprobs_offsets_are_cumulative(client):
    body = dict(model="stories", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    full = client.completions.create(**body).choices[0]
    chunks = list(client.completions.create(**body, stream=True))
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == full.logprobs.text_offset
    starts, position = [], 0
    for c in chunks:
        starts.append(position)
        position += len(c.choices[0].text)
    assert [c.choices[0].logprobs.text_offset[0] for c in chunks] == starts
    assert all(full.text[o:].startswith(t) for o, t in zip(full.logprobs.text_offset, full.logprobs.tokens))


def test_echo_with_logprobs_scores_the_prompt_like_transformers(client):
    """lm-eval-harness's loglikelihood call: echo + logprobs returns every prompt token's logprob."""
    ids = hf_tokenizer()(PROMPT + ", there was a dog").input_ids
    with torch.inference_mode():
        reference = hf_model()(torch.tensor([ids])).logits[0].log_softmax(-1)
    for _ in range(2):  # the second time the prompt is in the prefix cache, which echo + logprobs must bypass
        result = client.completions.create(model="stories", prompt=ids, max_tokens=1, temperature=0, echo=True,
                                           logprobs=2)
        lp = result.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(ids)]), want, atol=1e-4)
        # the top 2, and the prompt token if not among them
        for position, top in enumerate(lp.top_logprobs[1:len(ids)]):
            assert len(top) == (2 if ids[position + 1] in reference[position].topk(2).indices.tolist() else 3)
        assert len(lp.top_logprobs[-1]) == 2  # the greedy output token is the most likely
        assert result.choices[0].text.startswith(hf_tokenizer().decode(ids))  # "<s> Once": vLLM echoes decode(ids)
        assert lp.text_offset == sorted(lp.text_offset)


def test_prompt_logprobs_cross_the_processes_with_their_ranks(client):
    """vLLM's prompt_logprobs through the scheduler and worker processes (ranks and top-k over ZeroMQ), twice: the
    second time the prompt's blocks are cached, and every prompt token still gets its logprob."""
    ids = hf_tokenizer()(PROMPT + ", there was a little girl named Lily").input_ids
    with torch.inference_mode():
        reference = hf_model()(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    want = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    for _ in range(2):
        result = client.completions.create(model="stories", prompt=ids, max_tokens=1, temperature=0,
                                           extra_body={"prompt_logprobs": 2})
        entries = result.choices[0].model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids)
        own = [entry[str(token_id)] for entry, token_id in zip(entries[1:], ids[1:])]
        assert torch.allclose(torch.tensor([e["logprob"] for e in own]), want, atol=1e-4)
        ranks = torch.tensor([e["rank"] for e in own])  # exact but where another token is within 1e-4
        assert bool(((reference > want.unsqueeze(1) + 1e-4).sum(-1) < ranks).all())
        assert bool((ranks <= (reference >= want.unsqueeze(1) - 1e-4).sum(-1)).all())
        by_rank = [sorted((e["rank"], int(t)) for t, e in entry.items()) for entry in entries[1:]]
        assert [[t for rank, t in ranked if rank <= 2] for ranked in by_rank] == reference.topk(2).indices.tolist()
    chat = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
