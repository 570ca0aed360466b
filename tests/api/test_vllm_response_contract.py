"""Issue 43, the response contract of vLLM's server flags and echo, in process (the real aiohttp application over a
scripted engine), with the official `openai` client where it applies: --enable-force-include-usage,
--no-enable-prompt-tokens-details, --return-tokens-as-token-ids, and the echo of a token-id prompt."""

from __future__ import annotations

from shuttle.common.config import ApiConfig
from shuttle.common.messages import FinishReason
from tests.api.test_api_details import PROMPT, PROMPT_IDS, STORY, TOK, USER, openai_client, post, served, stream
from tests.fake_engine import TOP, FakeEngine, sampled_logprob

RESPONSES = "/v1/responses"


def named(token_id: int) -> str:
    return f"token_id:{token_id}"


# ---- --enable-force-include-usage ----------------------------------------------------------------------------------

async def test_forced_usage_rides_on_every_stream_whatever_stream_options_say():
    """As vLLM's should_include_usage with the flag: a last chunk with `usage` and no choices, and the usage so far on
    every chunk before it, with no stream_options or with include_usage false."""
    async with served(api=ApiConfig(enable_force_include_usage=True)) as (client, engine):
        api = openai_client(client)
        for create, body in ((api.completions.create, {"prompt": PROMPT}),
                             (api.chat.completions.create, {"messages": USER})):
            for options in ({}, {"stream_options": {"include_usage": False}}):
                chunks = [c async for c in await create(model="stories", max_tokens=5, stream=True, **body,
                                                        **options)]
                prompt_tokens = len(engine.submitted[-1].prompt_token_ids)
                last = chunks[-1]
                assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens,
                                               last.usage.total_tokens) == (prompt_tokens, 5, prompt_tokens + 5)
                so_far = [c.usage.completion_tokens for c in chunks[:-1]]
                assert so_far == sorted(so_far) and so_far[-1] == 5 and len(chunks) > 2
        # a whole response has usage anyway
        completion = await api.completions.create(model="stories", prompt=PROMPT, max_tokens=2)
        assert completion.usage.completion_tokens == 2


async def test_the_role_chunk_of_a_chat_stream_counts_no_output_token():
    """vLLM sends the role chunk before the first token: its usage so far is the prompt alone; each later chunk
    counts the tokens sent up to it."""
    async with served(api=ApiConfig(enable_force_include_usage=True)) as (client, engine):
        events = await stream(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 3})
        prompt_tokens = len(engine.submitted[-1].prompt_token_ids)
    assert [(e["choices"][0]["delta"].get("role") if e["choices"] else None, e["usage"]["completion_tokens"])
            for e in events] == [("assistant", 0), (None, 1), (None, 2), (None, 3), (None, 3)]
    assert all(e["usage"]["total_tokens"] == prompt_tokens + e["usage"]["completion_tokens"] for e in events)


async def test_without_the_flag_a_stream_has_usage_only_when_asked():
    async with served() as (client, _):
        api = openai_client(client)
        chunks = [c async for c in await api.completions.create(model="stories", prompt=PROMPT, max_tokens=5,
                                                                stream=True)]
        assert chunks[-1].choices and all(c.usage is None for c in chunks)
        chunks = [c async for c in await api.completions.create(model="stories", prompt=PROMPT, max_tokens=5,
                                                                stream=True, stream_options={"include_usage": True})]
        assert chunks[-1].usage.completion_tokens == 5 and all(c.usage is None for c in chunks[:-1])


# ---- --no-enable-prompt-tokens-details ---------------------------------------------------------------------------

async def test_prompt_tokens_details_are_left_out_when_turned_off():
    """Chat, completions (whole and streamed) and the Responses API alike."""
    for enabled in (True, False):
        async with served(api=ApiConfig(enable_prompt_tokens_details=enabled)) as (client, _):
            _, completion = await post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
            _, chat = await post(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 3})
            events = await stream(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 3,
                                                                   "stream_options": {"include_usage": True}})
            _, response = await post(client, RESPONSES, {"model": "stories", "input": PROMPT,
                                                         "max_output_tokens": 3})
        usages = [completion["usage"], chat["usage"], events[-1]["usage"]]
        assert [u["completion_tokens"] for u in usages] == [3, 3, 3] and response["usage"]["output_tokens"] == 3
        if enabled:  # the default: OpenAI's shape
            assert all(u["prompt_tokens_details"] == {"cached_tokens": 0} for u in usages)
            assert response["usage"]["input_tokens_details"] == {"cached_tokens": 0}
        else:
            assert all("prompt_tokens_details" not in u for u in usages)
            assert "input_tokens_details" not in response["usage"]


# ---- --return-tokens-as-token-ids ----------------------------------------------------------------------------------

def expected_top(position: int, k: int) -> dict[str, float]:
    """A completions top_logprobs entry of the fake engine's output token `position`, named by id: the k most
    likely, then the sampled token when it is not among them."""
    top = {named(t): v for t, v in TOP[:k]}
    sampled = STORY[position]
    return top if sampled in dict(TOP[:k]) else {**top, named(sampled): dict(TOP).get(sampled,
                                                                                      sampled_logprob(position))}


async def test_logprobs_name_tokens_by_id():
    """Completions (whole, streamed, and an echoed prompt) and chat: every token, sampled or among the top ones,
    is "token_id:ID"; chat's bytes are that name's UTF-8, as vLLM writes them; text and offsets stay the text's."""
    async with served() as (client, _):
        _, plain = await post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2})
    async with served(api=ApiConfig(return_tokens_as_token_ids=True)) as (client, _):
        _, result = await post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2})
        events = await stream(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2})
        _, echoed = await post(client, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 1, "logprobs": 1,
                                                           "echo": True})
        _, chat = await post(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": True,
                                                              "top_logprobs": 2})
    lp = result["choices"][0]["logprobs"]
    assert lp["tokens"] == [named(t) for t in STORY[:3]]
    assert lp["top_logprobs"] == [expected_top(p, 2) for p in range(3)]
    assert result["choices"][0]["text"] == plain["choices"][0]["text"]
    assert lp["text_offset"] == plain["choices"][0]["logprobs"]["text_offset"]
    assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == [named(t) for t in STORY[:3]]
    echo_lp = echoed["choices"][0]["logprobs"]
    assert echo_lp["tokens"] == [named(t) for t in PROMPT_IDS + STORY[:1]]
    assert echo_lp["top_logprobs"][0] is None
    assert all(set(top) <= {named(t) for t in PROMPT_IDS + STORY + [t for t, _ in TOP]}
               for top in echo_lp["top_logprobs"][1:])
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [named(t) for t in STORY[:3]]
    assert [c["bytes"] for c in content] == [list(named(t).encode()) for t in STORY[:3]]
    assert all([e["token"] for e in c["top_logprobs"]] == [named(t) for t, _ in TOP[:2]] for c in content)
    assert all([e["bytes"] for e in c["top_logprobs"]] == [list(named(t).encode()) for t, _ in TOP[:2]]
               for c in content)


async def test_the_request_field_overrides_the_flag():
    """vLLM's request field return_tokens_as_token_ids: true names tokens by id on a server without the flag, false
    by text on a server with it; left out, the flag decides."""
    body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": 0}
    chat = {"messages": USER, "max_tokens": 2, "logprobs": True}
    texts = [TOK.token_text(t)[0] for t in STORY[:2]]
    ids = [named(t) for t in STORY[:2]]
    for flag, field, expected in ((False, True, ids), (True, False, texts), (True, None, ids), (False, None, texts)):
        asked = {} if field is None else {"return_tokens_as_token_ids": field}
        async with served(api=ApiConfig(return_tokens_as_token_ids=flag)) as (client, _):
            status, result = await post(client, "/v1/completions", {**body, **asked})
            _, answer = await post(client, "/v1/chat/completions", {**chat, **asked})
        assert status == 200 and result["choices"][0]["logprobs"]["tokens"] == expected, (flag, field)
        assert [c["token"] for c in answer["choices"][0]["logprobs"]["content"]] == expected, (flag, field)


# ---- the echo of a token-id prompt -------------------------------------------------------------------------------

async def test_an_echoed_token_id_prompt_is_decoded_with_its_special_tokens():
    """vLLM echoes decode(ids), special tokens kept ("<s>"); a text prompt is echoed as it was given. The logprobs of
    the echo name each token as it shows in the echoed text, so they join into it and the offsets point into it."""
    with_special = TOK.decode(PROMPT_IDS, skip_special_tokens=False)
    assert with_special == "<s> Once upon a time"
    async with served(FakeEngine(script=STORY[:2], script_end=FinishReason.LENGTH)) as (client, _):
        _, ids = await post(client, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "logprobs": 0})
        _, text = await post(client, "/v1/completions", {"prompt": PROMPT, "echo": True})
        events = await stream(client, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True})
        _, several = await post(client, "/v1/completions", {"prompt": [PROMPT_IDS, [403, 407]], "echo": True,
                                                            "max_tokens": 1})
    choice = ids["choices"][0]
    assert choice["text"] == with_special + " there was"
    assert choice["logprobs"]["tokens"] == ["<s>", " Once", " upon", " a", " time", " there", " was"]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert choice["logprobs"]["text_offset"] == [0, 3, 8, 13, 15, 20, 26]
    assert text["choices"][0]["text"] == "Once upon a time there was"
    assert events[0]["choices"][0]["text"].startswith(with_special)
    assert "".join(e["choices"][0]["text"] for e in events) == with_special + " there was"
    assert [c["text"] for c in several["choices"]] == [with_special + " there", "Once upon there"]
