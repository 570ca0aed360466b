"""Issue 43, Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the chat machinery.

In process (the real application over the scripted engine, tests/fake_engine.py), with the official `anthropic`
client where it applies: the message object and the stream's events against the chat completion of the same
conversation (text, prompt and token counts), stop sequences, tool use both ways, count_tokens, the errors in
Anthropic's shape and the API key as x-api-key. End to end on the shared `server` (stories260K): greedy output equal
to the chat endpoint's, streamed or not.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import anthropic
import msgspec
import openai
import pytest
from aiohttp.test_utils import TestClient

from shuttle.common.config import ToolCallConfig
from shuttle.common.messages import FinishReason, RequestOutput
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.app import MAX_BODY_BYTES
from tests.api.test_api_details import STORY, STORY_TEXT, post, served
from tests.api.test_reasoning import served as served_thinking
from tests.api.test_reasoning import think_model  # noqa: F401 (the fixture: stories260K with think tokens)
from tests.api.test_tool_calling import NAMED_TEXT, REQUIRED_TEXT, script
from tests.fake_engine import FakeEngine

URL = "/v1/messages"
MODEL = "stories"
CONVERSATION = [{"role": "user", "content": "Tom had a ball."},
                {"role": "assistant", "content": "It was red."},
                {"role": "user", "content": [{"type": "text", "text": "Where did "},
                                             {"type": "text", "text": "it go?"}]}]
CHAT_CONVERSATION = [{"role": "system", "content": "Tell a story."}, *CONVERSATION]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time",
                                                "parameters": {"type": "object", "properties": {}}}}]
HERMES = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def anthropic_client(client: TestClient, **kwargs) -> anthropic.AsyncAnthropic:
    """The official client on `client`'s server (use it in `async with`, which closes it)."""
    return anthropic.AsyncAnthropic(base_url=str(client.make_url("")), max_retries=0,
                                    **{"api_key": "unused", **kwargs})


@asynccontextmanager
async def served_text(text: str, eos: bool = True, **config):
    """An in-process server (the tools chat template) whose engine writes `text`."""
    engine = FakeEngine(script=script(text, eos), script_end=FinishReason.LENGTH)
    async with served(engine, template="tools_chat.jinja", **config) as (client, engine):
        yield client, engine


async def events_of(client: TestClient, body: dict, **kwargs) -> list[dict]:
    """The data of each event of a streamed message, checking that each event's name is its data's type."""
    async with client.post(URL, json={**body, "stream": True}, **kwargs) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = (await response.read()).decode()
    out = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append(json.loads(data[len("data: "):]))
        assert out[-1]["type"] == name[len("event: "):]
    return out


# ---- text, against the chat completion of the same conversation -----------------------------------------------

async def test_a_message_and_its_stream_are_the_chat_completion_of_the_same_conversation():
    """system (a string) and the turns (text as a string or blocks) are the chat messages: the same prompt, the same
    text and token counts, streamed or not, through the official client."""
    async with served() as (client, engine):
        _, chat = await post(client, "/v1/chat/completions", {"messages": CHAT_CONVERSATION, "max_tokens": 64})
        async with anthropic_client(client) as api:
            message = await api.messages.create(model=MODEL, max_tokens=64, system="Tell a story.",
                                                messages=CONVERSATION, metadata={"user_id": "u-1"},
                                                extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
            async with api.messages.stream(model=MODEL, max_tokens=64, system="Tell a story.",
                                           messages=CONVERSATION) as stream:
                streamed_text = "".join([text async for text in stream.text_stream])
                final = await stream.get_final_message()
    text = chat["choices"][0]["message"]["content"]
    assert text == STORY_TEXT
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and [(b.type, b.text) for b in message.content] == [("text", text)]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    prompt = chat["usage"]["prompt_tokens"]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (prompt, chat["usage"]["completion_tokens"])
    assert message.usage.output_tokens == len(STORY) + 1  # and the end-of-sequence token
    assert [s.prompt_token_ids for s in engine.submitted[1:]] == [engine.submitted[0].prompt_token_ids] * 2
    assert len(engine.submitted[0].prompt_token_ids) == prompt
    sampling = engine.submitted[1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (0.5, 0.9, 7, 64)
    assert streamed_text == text and final.content[0].text == text and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt, len(STORY) + 1)


async def test_system_blocks_are_the_system_message():
    async with served() as (client, engine):
        status, body = await post(client, URL, {"model": MODEL, "max_tokens": 8, "messages": CONVERSATION,
                                                "system": [{"type": "text", "text": "Tell a "},
                                                           {"type": "text", "text": "story.",
                                                            "cache_control": {"type": "ephemeral"}}]})
        await post(client, "/v1/chat/completions", {"messages": CHAT_CONVERSATION, "max_tokens": 8})
    assert status == 200, body
    assert engine.submitted[0].prompt_token_ids == engine.submitted[1].prompt_token_ids


async def test_the_stream_events_in_order():
    async with served() as (client, engine):
        events = await events_of(client, {"model": MODEL, "max_tokens": 64, "messages": CONVERSATION})
    prompt = len(engine.submitted[0].prompt_token_ids)
    types = [e["type"] for e in events]
    assert types[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[3:-3]) == {"content_block_delta"}
    start = events[0]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": prompt, "output_tokens": 1}  # the first token is out
    assert events[2] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert {(d["index"], d["delta"]["type"]) for d in deltas} == {(0, "text_delta")}
    assert "".join(d["delta"]["text"] for d in deltas) == STORY_TEXT
    assert events[-3] == {"type": "content_block_stop", "index": 0}
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                          "usage": {"input_tokens": prompt, "output_tokens": len(STORY) + 1}}


async def test_cut_by_max_tokens():
    async with served() as (client, _):
        status, body = await post(client, URL, {"model": MODEL, "max_tokens": 3, "messages": CONVERSATION})
        events = await events_of(client, {"model": MODEL, "max_tokens": 3, "messages": CONVERSATION})
    assert status == 200, body
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 3
    assert body["content"] == [{"type": "text", "text": " there was a"}]
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


async def test_a_stop_sequence_ends_the_text_and_is_named():
    async with served() as (client, _):
        async with anthropic_client(client) as api:
            message = await api.messages.create(model=MODEL, max_tokens=64, messages=CONVERSATION,
                                                stop_sequences=["Moon", "Lily"])
        events = await events_of(client, {"model": MODEL, "max_tokens": 64, "messages": CONVERSATION,
                                          "stop_sequences": ["Lily"]})
    assert [b.text for b in message.content] == [" there was a little girl named "]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Lily")
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "Lily"}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == " there was a little girl named "


async def test_a_last_assistant_turn_is_continued():
    """Anthropic's prefill: the answer continues the last assistant turn, as chat's continue_final_message."""
    turns = [{"role": "user", "content": "Tom had a ball."}, {"role": "assistant", "content": "It was"}]
    async with served(template="turns_chat.jinja") as (client, engine):
        status, body = await post(client, URL, {"model": MODEL, "max_tokens": 4, "messages": turns})
        await post(client, "/v1/chat/completions", {"messages": turns, "max_tokens": 4,
                                                    "continue_final_message": True, "add_generation_prompt": False})
        await post(client, "/v1/chat/completions", {"messages": turns, "max_tokens": 4})
    assert status == 200, body
    first, continued, fresh = (s.prompt_token_ids for s in engine.submitted)
    assert first == continued != fresh


@pytest.mark.parametrize("block", [{"type": "thinking", "thinking": "Hmm.", "signature": ""},
                                   {"type": "redacted_thinking", "data": "x"}])
async def test_a_last_assistant_turn_of_thinking_alone_is_no_prefill(block):
    """Its thinking is left out of the prompt, so nothing of the turn is left to continue: the prompt is the one
    without it, ending with the generation prompt. A fresh-clone trial found the user's turn continued instead (the
    prefill flag read from the request, not from the prompt), the answer going on with the user's words."""
    turns = [{"role": "user", "content": "Tom had a ball."}]
    async with served(template="turns_chat.jinja") as (client, engine):
        for messages in (turns, [*turns, {"role": "assistant", "content": [block]}]):
            status, body = await post(client, URL, {"model": MODEL, "max_tokens": 4, "messages": messages})
            assert status == 200, body
    assert engine.submitted[0].prompt_token_ids == engine.submitted[1].prompt_token_ids


# ---- tools -------------------------------------------------------------------------------------------------------

async def test_a_named_tool_is_one_tool_use_block_under_its_grammar():
    async with served_text(NAMED_TEXT) as (client, engine):
        async with anthropic_client(client) as api:
            message = await api.messages.create(model=MODEL, max_tokens=64, messages=[
                {"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                tool_choice={"type": "tool", "name": "get_weather"})
            async with api.messages.stream(model=MODEL, max_tokens=64, messages=[
                    {"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                    tool_choice={"type": "tool", "name": "get_weather"}) as stream:
                final = await stream.get_final_message()
        events = await events_of(client, {"model": MODEL, "max_tokens": 64, "tools": TOOLS,
                                          "messages": [{"role": "user", "content": "Weather in Paris?"}],
                                          "tool_choice": {"type": "tool", "name": "get_weather"}})
    [block] = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert (block.name, block.input) == ("get_weather", {"city": "Paris"}) and message.stop_reason == "tool_use"
    constraint = engine.submitted[0].sampling.structured
    assert constraint == StructuredOutput(kind="json", spec=msgspec.json.encode(WEATHER).decode())
    [streamed] = final.content
    assert (streamed.type, streamed.name, streamed.input, final.stop_reason) == \
        ("tool_use", "get_weather", {"city": "Paris"}, "tool_use")
    start = events[2]
    assert start["type"] == "content_block_start" and start["content_block"]["id"].startswith("toolu_")
    assert {k: v for k, v in start["content_block"].items() if k != "id"} == \
        {"type": "tool_use", "name": "get_weather", "input": {}}
    pieces = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert {p["type"] for p in pieces} == {"input_json_delta"}
    assert "".join(p["partial_json"] for p in pieces) == NAMED_TEXT
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


async def test_a_named_tool_cut_by_max_tokens_has_the_same_input_whole_and_streamed():
    """A fresh-clone trial: cut inside its arguments, a tool_use's input was {} whole, and what the official client
    builds from the streamed input_json_delta pieces ({"city": "What is an"}) when streamed."""
    async with served_text('{"city": "What is an", "da', eos=False) as (client, engine):
        async with anthropic_client(client) as api:
            ask = dict(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Weather in Paris?"}],
                       tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
            message = await api.messages.create(**ask)
            async with api.messages.stream(**ask) as stream:
                final = await stream.get_final_message()
    [block], [streamed] = message.content, final.content
    assert (block.type, block.input, message.stop_reason) == ("tool_use", {"city": "What is an"}, "max_tokens")
    assert (streamed.type, streamed.input, final.stop_reason) == ("tool_use", block.input, "max_tokens")


async def test_any_is_required_calls_and_disable_parallel_tool_use_allows_one():
    async with served_text(REQUIRED_TEXT) as (client, engine):
        status, body = await post(client, URL, {"model": MODEL, "max_tokens": 150, "tools": TOOLS,
                                                "messages": [{"role": "user", "content": "Weather?"}],
                                                "tool_choice": {"type": "any"}})
        status_one, one = await post(client, URL, {
            "model": MODEL, "max_tokens": 150, "tools": TOOLS, "messages": [{"role": "user", "content": "Weather?"}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert status == status_one == 200, (body, one)
    assert [(b["type"], b["name"], b["input"]) for b in body["content"]] == \
        [("tool_use", "get_weather", {"city": "Paris"}), ("tool_use", "get_time", {})]
    assert len({b["id"] for b in body["content"]}) == 2 and body["stop_reason"] == "tool_use"
    assert [b["name"] for b in one["content"]] == ["get_weather"]
    many, single = (json.loads(s.sampling.structured.spec) for s in engine.submitted)
    assert "maxItems" not in many and single["maxItems"] == 1


async def test_auto_with_the_servers_parser_gives_text_then_tool_use():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    async with served_text(text, tool_calls=HERMES) as (client, _):
        status, body = await post(client, URL, {"model": MODEL, "max_tokens": 150, "tools": TOOLS,
                                                "messages": [{"role": "user", "content": "Weather?"}]})
        events = await events_of(client, {"model": MODEL, "max_tokens": 150, "tools": TOOLS,
                                          "messages": [{"role": "user", "content": "Weather?"}]})
    assert status == 200, body
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"] and body["stop_reason"] == "tool_use"
    assert body["content"][0]["text"].strip() == "Let me check." and body["content"][1]["input"] == {"city": "Paris"}
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == [(0, "text"), (1, "tool_use")] and stops == [0, 1]
    json_text = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                        and e["delta"]["type"] == "input_json_delta")
    assert json.loads(json_text) == {"city": "Paris"}


async def test_a_tool_round_trip_is_the_chat_conversation_with_tool_calls():
    """An assistant's tool_use blocks are its tool_calls, a user's tool_result blocks tool messages (before the turn's
    text): the same prompt as the chat request that says the same."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "noon"}],
                     "is_error": False},
                    {"type": "text", "text": "Answer briefly."}]}]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "noon"},
            {"role": "user", "content": "Answer briefly."}]
    async with served_text("Sunny at noon.") as (client, engine):
        async with anthropic_client(client) as api:
            message = await api.messages.create(model=MODEL, max_tokens=32, messages=messages, tools=TOOLS[1:],
                                                tool_choice={"type": "none"})
        status, body = await post(client, "/v1/chat/completions", {"messages": chat, "tools": CHAT_TOOLS[1:],
                                                                   "tool_choice": "none", "max_tokens": 32})
        async with anthropic_client(client) as api:
            counted = await api.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS[1:])
    assert status == 200, body
    assert engine.submitted[0].prompt_token_ids == engine.submitted[1].prompt_token_ids
    assert [(b.type, b.text) for b in message.content] == [("text", body["choices"][0]["message"]["content"])]
    assert message.stop_reason == "end_turn" and engine.submitted[0].sampling.structured is None
    assert counted.input_tokens == len(engine.submitted[0].prompt_token_ids)


# ---- a reasoning model's thinking ----------------------------------------------------------------------------------

async def test_the_thinking_is_a_thinking_block_before_the_answer(think_model):  # noqa: F811
    """Under --reasoning-parser: a thinking block, then the answer's text; streamed as thinking_delta pieces in a
    block of their own; an earlier turn's thinking block sent back is taken and left out of the prompt."""
    async with served_thinking(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, engine):
        async with anthropic_client(client) as api:
            message = await api.messages.create(model=MODEL, max_tokens=64, messages=[
                {"role": "user", "content": "Is 7 prime?"}])
            async with api.messages.stream(model=MODEL, max_tokens=64, messages=[
                    {"role": "user", "content": "Is 7 prime?"}]) as stream:
                final = await stream.get_final_message()
            await api.messages.create(model=MODEL, max_tokens=4, messages=[
                {"role": "user", "content": "Is 7 prime?"},
                {"role": "assistant", "content": [b.model_dump() for b in message.content]},
                {"role": "user", "content": "And 9?"}])
        events = await events_of(client, {"model": MODEL, "max_tokens": 64,
                                          "messages": [{"role": "user", "content": "Is 7 prime?"}]})
        await post(client, "/v1/chat/completions", {"max_tokens": 4, "messages": [
            {"role": "user", "content": "Is 7 prime?"}, {"role": "assistant", "content": "Yes, it is."},
            {"role": "user", "content": "And 9?"}]})
    assert [b.model_dump() for b in message.content] == [
        {"type": "thinking", "thinking": "Seven has no divisors.", "signature": ""},
        {"type": "text", "text": "Yes, it is.", "citations": None}]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    assert message.stop_reason == "end_turn"
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    assert thinking == "Seven has no divisors."
    assert {e["delta"]["type"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0} == \
        {"thinking_delta"}
    assert engine.submitted[2].prompt_token_ids == engine.submitted[4].prompt_token_ids


# ---- count_tokens --------------------------------------------------------------------------------------------------

async def test_count_tokens_is_the_prompts_token_count():
    async with served() as (client, engine):
        async with anthropic_client(client) as api:
            counted = await api.messages.count_tokens(model=MODEL, system="Tell a story.", messages=CONVERSATION)
            message = await api.messages.create(model=MODEL, max_tokens=4, system="Tell a story.",
                                                messages=CONVERSATION)
    assert counted.input_tokens == len(engine.submitted[0].prompt_token_ids) == message.usage.input_tokens
    assert counted.input_tokens > 8


@pytest.mark.parametrize("fields", [
    {"tool_choice": {"type": "any"}},  # without tools
    {"messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": [
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}],
     "tools": TOOLS},  # one id, two calls: which did the result answer?
])
async def test_count_tokens_refuses_what_a_messages_request_refuses(fields):
    """A fresh-clone trial: count_tokens counted tool_choice "any" without tools, which /v1/messages refuses, and
    both took two tool_use blocks of one id."""
    body = {"model": MODEL, "messages": CONVERSATION, **fields}
    async with served() as (client, engine):
        counted, count_body = await post(client, "/v1/messages/count_tokens", body)
        status, answer = await post(client, URL, {**body, "max_tokens": 2})
    assert (counted, status) == (400, 400) and engine.submitted == []
    assert count_body["error"]["message"] == answer["error"]["message"], (count_body, answer)


@pytest.mark.parametrize("repeats", [300, 40_000])  # 8,100 characters (in place), 1.1 MB (tokenized off the GIL)
async def test_count_tokens_counts_a_prompt_far_over_the_context(repeats):
    from tests.conftest import hf_tokenizer
    text = "Once upon a time, Lily ran." * repeats
    expected = len(hf_tokenizer()(text).input_ids)  # the template is BOS + the content
    async with served() as (client, engine):
        status, counted = await post(client, "/v1/messages/count_tokens",
                                     {"model": MODEL, "messages": [{"role": "user", "content": text}]})
        refused, answer = await post(client, URL, {**BASE, "messages": [{"role": "user", "content": text}]})
    assert (status, counted) == (200, {"input_tokens": expected}) and expected > 512
    assert refused == 400 and answer["error"]["type"] == "invalid_request_error"  # a generation is still refused
    assert engine.submitted == []


# ---- errors in Anthropic's shape ---------------------------------------------------------------------------------

BASE = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("body, words", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({**BASE, "max_tokens": 0}, "max_tokens"),
    ({**BASE, "messages": [{"role": "system", "content": "Hi"}]}, "role"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages[0].content[0] is of type 'image'"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "hologram", "text": "Hi"}]}]},
     "messages[0].content[0] is of type 'hologram'"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "in a user turn only text and tool_result"),
    ({**BASE, "messages": []}, "at least one message"),
    ({**BASE, "messages": [{"role": "user", "content": ""}]}, "messages[0].content must not be empty"),
    ({**BASE, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []},
                           {"role": "user", "content": "Go on"}]}, "messages[1].content must not be empty"),
    ({**BASE, "messages": [{"role": "user", "content": []}]}, "messages[0].content must not be empty"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
     "messages[0].content[0].tool_use_id 'nope' answers no tool_use block of an earlier assistant message"),
    ({**BASE, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "b"}]}]}, "tool_use_id 'b' answers no tool_use block"),
    ({**BASE, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "in an assistant turn only text, tool_use"),
    ({**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking is not supported"),
    ({**BASE, "speed": "fast"}, 'speed is supported only as "standard"'),
    ({**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
    ({**BASE, "tool_choice": {"type": "tool"}}, "tool_choice.name is required"),
    ({**BASE, "tool_choice": {"type": "any"}}, "tool_choice needs tools"),
    ({**BASE, "stop_sequences": [""]}, "stop_sequences must be"),
    ({**BASE, "echo": True}, "echo"),
    ({**BASE, "temperature": 1.5}, "<= 1.0"),
    ({**BASE, "temperature": -0.1}, ">= 0.0"),
    # the chat machinery's checks in this API's words (a trial: they named response_format and function.parameters)
    ({**BASE, "output_config": {"format": {"type": "json_schema", "schema": {"type": "strng"}}}},
     "output_config.format.schema at /type: `type` must be one of"),
    ({**BASE, "tools": [{"name": "f", "input_schema": {"type": "object"}},
                        {"name": "g", "input_schema": {"type": "strng"}}], "tool_choice": {"type": "any"}},
     "tools[1].input_schema at /type: `type` must be one of"),
])
async def test_bad_input_is_an_anthropic_invalid_request_error(body, words):
    async with served() as (client, engine):
        status, answer = await post(client, URL, body)
        stream_status, _ = await post(client, URL, {**body, "stream": True})
    assert (status, stream_status) == (400, 400), answer
    assert set(answer) == {"type", "error"} and answer["type"] == "error"
    assert set(answer["error"]) == {"type", "message"} and answer["error"]["type"] == "invalid_request_error"
    assert words in answer["error"]["message"]
    assert engine.submitted == []


async def test_a_lone_surrogate_is_named_as_one_on_messages_as_on_the_openai_routes():
    lone = "request body is not valid JSON: it escapes a lone UTF-16 surrogate (\\ud800-\\udfff outside a high-low " \
           "pair), which is no Unicode character"
    async with served() as (client, engine):
        answers = {}
        for path, text in (("/v1/messages", "\\ud800"), ("/v1/messages/count_tokens", "Hi \\ud800 there"),
                           ("/v1/responses", "\\ud800"), ("/v1/messages", "\\udc00")):
            body = f'{{"model": "{MODEL}", "max_tokens": 2, "input": "{text}", "messages": [' \
                   f'{{"role": "user", "content": "{text}"}}]}}'.encode()
            async with client.post(path, data=body, headers={"Content-Type": "application/json"}) as response:
                answer = await response.json()
            message = answer["error"]["message"]
            answers[path + text] = (response.status, message)
    assert set(answers.values()) == {(400, lone)}, answers
    assert engine.submitted == []


async def test_the_client_raises_the_errors_it_knows():
    async with served() as (client, _):
        async with anthropic_client(client) as api:
            with pytest.raises(anthropic.BadRequestError) as bad:
                await api.messages.create(model=MODEL, max_tokens=8, messages=[
                    {"role": "user", "content": [{"type": "document", "source": {
                        "type": "text", "media_type": "text/plain", "data": "Hi"}}]}])
            with pytest.raises(anthropic.NotFoundError) as missing:
                await api.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=BASE["messages"])
            with pytest.raises(anthropic.NotFoundError):
                await api.messages.count_tokens(model="claude-sonnet-4-5", messages=BASE["messages"])
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "'document'" in bad.value.message
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error",
        "message": "The model `claude-sonnet-4-5` does not exist; this server serves `stories`"}}


async def test_an_engine_refusal_before_the_first_event_is_an_http_status_in_anthropics_shape():
    engine = FakeEngine(error=(503, "the server is at capacity"), retry_after_s=2.0)
    async with served(engine) as (client, _):
        async with client.post(URL, json={**BASE, "stream": True}) as response:
            status, answer, headers = response.status, await response.json(), response.headers
    assert status == 503 and "Retry-After" in headers
    assert answer == {"type": "error", "error": {"type": "overloaded_error", "message": "the server is at capacity"}}


class FailingMidway(FakeEngine):
    """Writes the script's first two tokens, then fails the request (a worker lost mid-generation)."""

    def _outputs(self, request):
        outputs = super()._outputs(request)
        yield next(outputs)
        yield next(outputs)
        yield RequestOutput(request_id=request.request_id, finish_reason=FinishReason.ERROR, error_status=500,
                            error_message="the worker failed")


async def test_a_failure_after_the_first_event_is_an_error_event_in_anthropics_shape():
    async with served(FailingMidway(script=list(STORY))) as (client, _):
        events = await events_of(client, BASE)
        async with anthropic_client(client) as api:
            with pytest.raises(anthropic.APIStatusError) as failed:
                async with api.messages.stream(**BASE) as stream:
                    async for _ in stream:
                        pass
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "the worker failed"}}
    assert "message_stop" not in [e["type"] for e in events]
    assert failed.value.body == events[-1]


async def test_a_body_over_the_limit_is_an_anthropic_413():
    async with served() as (client, engine):
        async with client.post(URL, data=b" " * (MAX_BODY_BYTES + 1),
                               headers={"Content-Type": "application/json"}) as response:
            status, answer = response.status, await response.json()
    assert status == 413 and answer["type"] == "error" and answer["error"]["type"] == "request_too_large"
    assert engine.submitted == []


async def test_other_paths_keep_openais_error_shape():
    async with served() as (client, _):
        status, answer = await post(client, "/v1/chat/completions", {"messages": []})
    assert status == 400 and set(answer) == {"error"} and answer["error"]["code"] == 400


# ---- the API key ---------------------------------------------------------------------------------------------------

KEY = "sk-anthropic-test"


async def test_the_api_key_as_x_api_key_on_the_messages_routes_only():
    async with served(api_key=KEY) as (client, engine):
        ok, body = await post(client, URL, BASE, headers={"x-api-key": KEY})
        counted, _ = await post(client, f"{URL}/count_tokens", {"model": MODEL, "messages": BASE["messages"]},
                                headers={"x-api-key": KEY})
        bearer, _ = await post(client, URL, BASE, headers={"Authorization": f"Bearer {KEY}"})
        wrong, refusal = await post(client, URL, BASE, headers={"x-api-key": "sk-wrong"})
        missing, _ = await post(client, URL, BASE)
        chat, chat_refusal = await post(client, "/v1/chat/completions", {"messages": BASE["messages"]},
                                        headers={"x-api-key": KEY})
        async with anthropic_client(client, api_key=KEY) as api:
            message = await api.messages.create(**BASE)
        async with anthropic_client(client, api_key=None, default_headers={"x-api-key": KEY}) as api:
            by_header = await api.messages.create(**BASE)
    assert (ok, counted, bearer, wrong, missing, chat) == (200, 200, 200, 401, 401, 401), body
    assert refusal == {"type": "error", "error": {
        "type": "authentication_error",
        "message": "invalid or missing API key: send Authorization: Bearer <key> or x-api-key: <key>"}}
    assert chat_refusal["error"]["code"] == 401  # OpenAI's routes take the Bearer form only, as vLLM's
    assert message.content[0].text == by_header.content[0].text == STORY_TEXT[:len(message.content[0].text)]
    assert len(engine.submitted) == 4  # count_tokens submits nothing


# ---- end to end on stories260K ---------------------------------------------------------------------------------

def test_greedy_message_equals_the_chat_completion_streamed_or_not(server):
    api = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    chat_api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    turns = [{"role": "user", "content": "Once upon a time"}]
    # this client's create() has no sampling parameters (Anthropic's newest models take none): sent as extra_body
    kwargs = dict(model="stories260K", max_tokens=16, messages=turns, extra_body={"temperature": 0})
    try:
        message = api.messages.create(**kwargs)
        chat = chat_api.chat.completions.create(model="stories260K", max_tokens=16, temperature=0, messages=turns)
        with api.messages.stream(**kwargs) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        counted = api.messages.count_tokens(model="stories260K", messages=turns)
    finally:
        api.close()
        chat_api.close()
    text = chat.choices[0].message.content
    assert text and message.content[0].text == text == streamed == final.content[0].text
    assert message.stop_reason == final.stop_reason == \
        {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.usage.input_tokens == final.usage.input_tokens == counted.input_tokens == \
        chat.usage.prompt_tokens
    assert message.usage.output_tokens == final.usage.output_tokens == chat.usage.completion_tokens


@pytest.mark.parametrize("fields, where", [
    ({"metadata": {"user_id": "u1", "plan": "pro"}}, "unknown field `plan` - at `$.metadata`"),
    ({"service_tier": "fastest"}, "Invalid enum value 'fastest' - at `$.service_tier`"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "messages[0].content[0]"),
    ({"system": [{"type": "text", "text": ""}]}, "system[0]"),
])
async def test_fields_anthropic_checks_are_checked_here_too(fields, where):
    """A fresh-clone trial: these were taken silently where Anthropic's API refuses them (metadata holds only
    user_id; service_tier is auto or standard_only; a text block is never empty)."""
    async with served() as (client, engine):
        status, body = await post(client, URL, {"model": MODEL, "max_tokens": 2, "messages": CONVERSATION, **fields})
        ok, _ = await post(client, URL, {"model": MODEL, "max_tokens": 2, "messages": CONVERSATION,
                                         "metadata": {"user_id": "u1"}, "service_tier": "standard_only"})
    assert status == 400 and body["type"] == "error" and where in body["error"]["message"], body
    assert ok == 200 and len(engine.submitted) == 1
