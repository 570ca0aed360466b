"""Issue 8 API items that need the real engine's output: a character split between a token-id prompt and the first
output token (and, issue 24, a stop string that such a character completes), and min_tokens holding back a stop
string in greedy output."""

import aiohttp

from tests.client import post_completion, stream_completion
from tests.conftest import hf_greedy, hf_tokenizer


async def test_character_split_between_prompt_and_output_is_reassembled(server):
    # "Once" and the first three bytes of U+1F600; logit_bias forces the fourth (<0x80>, id 131)
    body = {"prompt": [1, 403, 243, 162, 155], "max_tokens": 1, "logit_bias": {"131": 100}, "return_token_ids": True}
    async with aiohttp.ClientSession() as session:
        status, result = await post_completion(session, server.url, **body)
        events = await stream_completion(session, server.url, **body)
    assert status == 200 and result["choices"][0]["token_ids"] == [131]
    assert result["choices"][0]["text"] == "😀" == "".join(e["choices"][0]["text"] for e in events)


async def test_a_stop_string_completed_by_a_byte_token_stops_whatever_follows(server):
    # issue 24: with max_tokens 2 the second <0x80> used to spoil the emoji's run, so "😀" never stopped the output
    body = {"prompt": [1, 403, 243, 162, 155], "max_tokens": 2, "logit_bias": {"131": 100}, "temperature": 0,
            "stop": ["😀"]}
    async with aiohttp.ClientSession() as session:
        status, result = await post_completion(session, server.url, **body)
        events = await stream_completion(session, server.url, **body)
    assert status == 200 and (result["choices"][0]["text"], result["choices"][0]["finish_reason"]) == ("", "stop")
    assert "".join(e["choices"][0]["text"] for e in events) == ""
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["stop"]


async def test_min_tokens_holds_back_stop_strings(server):
    prompt, stop, min_tokens = "Once upon a time", "girl", 12
    prompt_ids = hf_tokenizer()(prompt).input_ids
    greedy = hf_greedy(prompt_ids, 40)

    def text_of(output_ids: list[int]) -> str:
        return hf_tokenizer().decode(prompt_ids + output_ids, skip_special_tokens=True)[len(prompt):]

    full = text_of(greedy)
    boundary = len(text_of(greedy[:min_tokens]))  # the text of the first min_tokens tokens is always kept whole
    assert full.index(stop) < boundary  # without min_tokens the output would end at the first "girl"
    index = full.find(stop, boundary)
    expected = full if index < 0 else full[:index]
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop], "min_tokens": min_tokens,
            "return_token_ids": True}
    async with aiohttp.ClientSession() as session:
        status, result = await post_completion(session, server.url, **body)
        events = await stream_completion(session, server.url, **body)
    [choice] = result["choices"]
    assert status == 200 and choice["text"] == expected
    assert len(choice["token_ids"]) >= min_tokens and choice["token_ids"] == greedy[:len(choice["token_ids"])]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
