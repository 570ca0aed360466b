"""Issue 27, tool calling on /v1/chat/completions as vLLM exposes it: the tools fields, the constraint tool_choice
"required" or a named function puts on the output, the refusals, the chat template's tools and tool-call history,
and the whole and streamed responses (message, tool_calls, finish_reason) for hermes auto, required and named
output.

In process: the real application over a scripted engine (tests/fake_engine.py), which ignores the grammar, so every
script is a text the grammar would allow.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import msgspec
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer

from shuttle.common.api_config import TOOL_CALL_PARSERS, ToolCallConfig
from shuttle.common.messages import FinishReason
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.request.chat_template import ChatTemplate
from shuttle.frontend.request.protocol import ChatMessage
from shuttle.frontend.tokenizer import TextTokenizer
from shuttle.frontend.tools.parsers import PARSERS
from shuttle.frontend.tools.request import (
    AUTO_NEEDS,
    NamedToolChoice,
    Tool,
    ToolChoice,
    template_tools,
    tool_constraint,
    tool_use_of,
)
from tests.fake_engine import SERVED, TEMPLATES, FakeEngine, frontend_app
from tests.server import MODEL_DIR

CHAT = "/v1/chat/completions"
TOK = TextTokenizer(str(MODEL_DIR))
EOS = 2
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]  # no parameters: none
AUTO = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
NAMED = {"type": "function", "function": {"name": "get_weather"}}

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
REQUIRED_TEXT = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
NAMED_TEXT = '{"city": "Paris"}'


def script(text: str, eos: bool = True) -> list[int]:
    """Token ids the fake engine generates for `text` (ending with end-of-sequence, a stop, unless not `eos`). The
    tokenizer prepends "▁" (a space) to a text, which an output would keep: its first token is spelled without it."""
    plain = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = plain.encode(text, add_special_tokens=False).ids
    first = plain.id_to_token(ids[0]).removeprefix("\u2581")
    spelled = [plain.token_to_id(c) or plain.token_to_id(f"<0x{ord(c):02X}>") for c in first]
    return spelled + ids[1:] + ([EOS] if eos else [])


@asynccontextmanager
async def served(text: str, tool_calls: ToolCallConfig = AUTO, eos: bool = True):
    """An in-process server whose engine writes `text`; yields (test client, engine)."""
    engine = FakeEngine(script=script(text, eos), script_end=FinishReason.LENGTH)
    app = frontend_app(engine, template="tools_chat.jinja", tool_calls=tool_calls)
    async with TestClient(TestServer(app)) as client:
        yield client, engine


async def post(client: TestClient, body: dict) -> tuple[int, dict]:
    async with client.post(CHAT, json=body) as response:
        return response.status, await response.json()


async def stream(client: TestClient, body: dict) -> list[dict]:
    async with client.post(CHAT, json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        events = [line.decode().strip()[len("data: "):] async for line in response.content
                  if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def tools_of(raw: list[dict]) -> list[Tool]:
    return msgspec.convert(raw, list[Tool])


def test_every_tool_call_parser_flag_has_a_parser():
    assert set(TOOL_CALL_PARSERS) == PARSERS.keys()


# ---- the constraint -----------------------------------------------------------------------------------------------

def test_required_forces_an_array_of_calls_to_listed_tools():
    use = tool_use_of(tools_of(TOOLS), "required", True, auto_tool_choice=False)
    structured = tool_constraint(use)
    assert structured.kind == "json"
    assert json.loads(structured.spec) == {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": WEATHER},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"enum": ["get_time"]},
                                          "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"], "additionalProperties": False}]}}
    # "name" comes before "parameters", so the grammar makes the model name the function first
    call = json.loads(structured.spec)["items"]["anyOf"][0]
    assert list(call["properties"]) == ["name", "parameters"] and call["required"] == ["name", "parameters"]
    assert structured.spec == msgspec.json.encode(json.loads(structured.spec)).decode()


def test_required_without_parallel_calls_allows_one():
    schema = json.loads(tool_constraint(tool_use_of(tools_of(TOOLS), "required", False, False)).spec)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)


def test_named_forces_that_functions_arguments():
    structured = tool_constraint(tool_use_of(tools_of(TOOLS), msgspec.convert(NAMED, NamedToolChoice), True, False))
    assert structured == StructuredOutput(kind="json", spec=msgspec.json.encode(WEATHER).decode())
    time = msgspec.convert({"type": "function", "function": {"name": "get_time"}}, NamedToolChoice)
    assert json.loads(tool_constraint(tool_use_of(tools_of(TOOLS), time, True, False)).spec) == \
        {"type": "object", "properties": {}}


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_none_and_auto_leave_the_output_free(choice):
    assert tool_constraint(tool_use_of(tools_of(TOOLS), choice, True, True)) is None


def test_tools_without_tool_choice_mean_auto():
    assert tool_use_of(tools_of(TOOLS), None, True, True).choice == "auto"
    assert tool_use_of(None, None, True, False).choice == "none"
    assert tool_use_of([], None, True, False).choice == "none"


# ---- refusals -----------------------------------------------------------------------------------------------------

BAD_ARGUMENTS = [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]}]
# (server's tool config, body fields, param)
REFUSALS = [
    (ToolCallConfig(), {"tools": TOOLS}, "tool_choice"),  # auto by default, and the server has no parser
    (ToolCallConfig(), {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    (ToolCallConfig(tool_call_parser="hermes"), {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    (AUTO, {"tool_choice": "required"}, "tool_choice"),
    (AUTO, {"tool_choice": "auto"}, "tool_choice"),
    (AUTO, {"tools": [], "tool_choice": "required"}, "tool_choice"),
    (AUTO, {"tool_choice": NAMED}, "tool_choice"),
    (AUTO, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    (AUTO, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (AUTO, {"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    (AUTO, {"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    (AUTO, {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    (AUTO, {"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools"),
    (AUTO, {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    (AUTO, {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    (AUTO, {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    (AUTO, {"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]}, "tools"),
    (AUTO, {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (AUTO, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_schema"}},
     "response_format"),  # the body's own constraint is still checked beside a forced call
    (AUTO, {"functions": [TOOLS[0]["function"]]}, "functions"),
    (AUTO, {"function_call": "auto"}, "function_call"),
    (AUTO, {"messages": USER + BAD_ARGUMENTS}, "messages"),
    (AUTO, {"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    (AUTO, {"messages": USER + [{"role": "assistant", "content": None, "tool_calls": []}]}, "messages"),
    (AUTO, {"messages": [{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
]


@pytest.mark.parametrize("config, fields, param", REFUSALS, ids=[f"{p}-{json.dumps(f)[:40]}" for _, f, p in REFUSALS])
async def test_refused_with_the_field_named(config, fields, param):
    async with served(NAMED_TEXT, config) as (client, engine):
        for streamed in (False, True):
            status, body = await post(client, {"messages": USER, **fields, "stream": streamed})
            assert status == 400, body
            assert (body["error"]["param"], body["error"]["code"]) == (param, 400), body
        assert engine.submitted == []


async def test_refusal_messages_say_what_to_do():
    async with served(NAMED_TEXT, ToolCallConfig()) as (client, _):
        _, body = await post(client, {"messages": USER, "tools": TOOLS})
        assert body["error"]["message"] == AUTO_NEEDS
        _, body = await post(client, {"messages": USER, "functions": [TOOLS[0]["function"]]})
        assert "use tools" in body["error"]["message"]
        _, body = await post(client, {"messages": USER, "function_call": "none"})
        assert "use tool_choice" in body["error"]["message"]


@pytest.mark.parametrize("fields", [{"tool_choice": "none"}, {"tools": TOOLS, "tool_choice": "none"}, {"tools": []},
                                    {"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": False}])
async def test_no_tool_calls_asked_for_is_plain_text(fields):
    async with served(HERMES_TEXT, ToolCallConfig()) as (client, engine):
        status, body = await post(client, {"messages": USER, **fields})
        assert status == 200, body
        assert body["choices"][0]["message"] == {"role": "assistant", "content": HERMES_TEXT}
        assert body["choices"][0]["finish_reason"] == "stop"
        assert engine.submitted[0].sampling.structured is None


# ---- the chat template --------------------------------------------------------------------------------------------

HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call-2", "name": "get_time", "content": "noon"},
]
TOOLS_SYSTEM = (
    '<|im_start|>system\n<tools>\n'
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}\n'
    '</tools><|im_end|>\n')
RENDERED_HISTORY = (
    TOOLS_SYSTEM + '<|im_start|>user\nWeather in Paris?<|im_end|>\n'
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response id="call-1">\nsunny\n</tool_response>\n'
    '<tool_response id="call-2">\nnoon\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


def test_the_template_gets_the_tools_and_the_calls_with_arguments_as_objects():
    template = ChatTemplate(str(MODEL_DIR), str(TEMPLATES / "tools_chat.jinja"))
    messages = msgspec.convert(HISTORY, list[ChatMessage])
    assert template.render(messages, tools=template_tools(tools_of(TOOLS))) == RENDERED_HISTORY
    # without tools the template writes no tools block
    assert template.render(msgspec.convert(USER, list[ChatMessage])) == \
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"


async def test_the_prompt_holds_the_tools_and_the_history():
    template = ChatTemplate(str(MODEL_DIR), str(TEMPLATES / "tools_chat.jinja"))
    tools = TOOLS[1:]  # what fits in stories260K's 512 tokens beside the history
    text = template.render(msgspec.convert(HISTORY, list[ChatMessage]), tools=template_tools(tools_of(tools)))
    assert text.startswith('<|im_start|>system\n<tools>\n{"type": "function", "function": {"name": "get_time"')
    async with served(NAMED_TEXT) as (client, engine):
        status, body = await post(client, {"messages": HISTORY, "tools": tools})
        assert status == 200, body
        assert engine.submitted[0].prompt_token_ids == TOK.encode_chat(text, False, 512)
        # tool_choice "none" still shows the tools to the template, as vLLM does
        status, body = await post(client, {"messages": HISTORY, "tools": tools, "tool_choice": "none"})
        assert engine.submitted[1].prompt_token_ids == engine.submitted[0].prompt_token_ids
        # /tokenize renders the same prompt
        async with client.post("/tokenize", json={"messages": HISTORY, "tools": tools}) as response:
            assert response.status == 200
            assert (await response.json())["tokens"] == engine.submitted[0].prompt_token_ids


# ---- responses ----------------------------------------------------------------------------------------------------

WEATHER_CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
TIME_CALL = {"name": "get_time", "arguments": "{}"}
# (server, request fields, script, the message's content, its calls, structured output submitted)
CASES = {
    "hermes auto": (AUTO, {"tools": TOOLS}, HERMES_TEXT, "Let me check.", [WEATHER_CALL, TIME_CALL], None),
    "required": (ToolCallConfig(), {"tools": TOOLS, "tool_choice": "required"}, REQUIRED_TEXT, None,
                 [WEATHER_CALL, TIME_CALL], "required"),
    "named": (ToolCallConfig(), {"tools": TOOLS, "tool_choice": NAMED}, NAMED_TEXT, None, [WEATHER_CALL], "named"),
}


def calls_of(message: dict) -> list[dict]:
    calls = message.get("tool_calls", [])
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert len(call["id"]) == len("chatcmpl-tool-") + 32 and int(call["id"][-32:], 16) >= 0
    return [call["function"] for call in calls]


def expected_constraint(kind: str | None, fields: dict):
    if kind is None:
        return None
    choice = "required" if kind == "required" else msgspec.convert(NAMED, NamedToolChoice)
    return tool_constraint(tool_use_of(tools_of(fields["tools"]), choice, True, False))


@pytest.mark.parametrize("case", CASES)
async def test_whole_response(case):
    config, fields, text, content, calls, kind = CASES[case]
    async with served(text, config) as (client, engine):
        status, body = await post(client, {"messages": USER, **fields})
        assert status == 200, body
        choice = body["choices"][0]
        assert set(choice["message"]) == {"role", "content", "tool_calls"}
        assert (choice["message"]["role"], choice["message"]["content"]) == ("assistant", content)
        assert calls_of(choice["message"]) == calls
        ids = [c["id"] for c in choice["message"]["tool_calls"]]
        assert len(set(ids)) == len(ids)
        assert choice["finish_reason"] == "tool_calls"
        assert engine.submitted[0].sampling.structured == expected_constraint(kind, fields)


@pytest.mark.parametrize("case", CASES)
async def test_streamed_response_adds_up_to_the_whole_one(case):
    config, fields, text, content, calls, _ = CASES[case]
    async with served(text, config) as (client, _):
        chunks = await stream(client, {"messages": USER, **fields})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    streamed: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in streamed:  # a call's first piece: its id, type and name
                assert piece["index"] == len(streamed)
                assert set(piece) == {"index", "id", "type", "function"} and piece["type"] == "function"
                assert piece["id"].startswith("chatcmpl-tool-")
                streamed[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"],
                                            "arguments": piece["function"]["arguments"]}
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                streamed[piece["index"]]["arguments"] += piece["function"]["arguments"]
    assert [{"name": s["name"], "arguments": s["arguments"]} for s in streamed.values()] == calls
    assert len({s["id"] for s in streamed.values()}) == len(calls)


async def test_hermes_text_without_calls_is_content_and_stops():
    async with served("It is sunny.", AUTO) as (client, _):
        status, body = await post(client, {"messages": USER, "tools": TOOLS})
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
        assert body["choices"][0]["finish_reason"] == "stop"
        chunks = await stream(client, {"messages": USER, "tools": TOOLS})
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "It is sunny."
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


async def test_a_cut_output_keeps_length():
    cut = HERMES_TEXT.split("<tool_call>\n{\"name\": \"get_time\"")[0]  # the first call whole, then max_tokens
    async with served(cut, AUTO, eos=False) as (client, _):
        status, body = await post(client, {"messages": USER, "tools": TOOLS})
        assert calls_of(body["choices"][0]["message"]) == [WEATHER_CALL]
        assert body["choices"][0]["finish_reason"] == "length"
        chunks = await stream(client, {"messages": USER, "tools": TOOLS})
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stop", [{"stop": ["Paris"]}, {"stop_token_ids": "Paris"}])
@pytest.mark.parametrize("choice", ["required", NAMED])
async def test_a_call_cut_by_the_requests_stop_finishes_with_stop_not_tool_calls(choice, stop):
    """A trial: a forced call cut by a stop string was "tool_calls" with arguments that are not JSON; as a length
    cut keeps "length", a stop the request set keeps "stop" (whole and streamed, and the Messages API's
    stop_sequence)."""
    text = REQUIRED_TEXT if choice == "required" else NAMED_TEXT
    if "stop_token_ids" in stop:  # "P", the first token of Paris as the scripted output spells it
        stop = {"stop_token_ids": [Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).token_to_id("P")]}
    fields = {"messages": USER, "tools": TOOLS, "tool_choice": choice, **stop}
    async with served(text, ToolCallConfig()) as (client, _):
        status, body = await post(client, fields)
        chunks = await stream(client, fields)
        if "stop" in stop:
            async with client.post("/v1/messages", json={
                    "model": SERVED, "max_tokens": 64, "messages": USER, "stop_sequences": ["Paris"],
                    "tools": [{"name": "get_weather", "input_schema": WEATHER}],
                    "tool_choice": {"type": "tool", "name": "get_weather"}}) as response:
                message = await response.json()
            assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "Paris"), message
    [call] = calls_of(body["choices"][0]["message"])[:1]
    assert call["name"] == "get_weather" and "Paris" not in call["arguments"]
    assert body["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_without_parallel_calls_auto_keeps_the_first_call():
    async with served(HERMES_TEXT, AUTO) as (client, _):
        fields = {"messages": USER, "tools": TOOLS, "parallel_tool_calls": False}
        status, body = await post(client, fields)
        assert calls_of(body["choices"][0]["message"]) == [WEATHER_CALL]
        chunks = await stream(client, fields)
        pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls", [])]
        assert {p["index"] for p in pieces} == {0}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_each_choice_parses_its_own_calls_with_ids_of_its_own():
    async with served(NAMED_TEXT, ToolCallConfig()) as (client, _):
        fields = {"messages": USER, "tools": TOOLS, "tool_choice": NAMED, "n": 3}
        status, body = await post(client, fields)
        assert [calls_of(c["message"]) for c in body["choices"]] == [[WEATHER_CALL]] * 3
        ids = {c["message"]["tool_calls"][0]["id"] for c in body["choices"]}
        assert len(ids) == 3
        chunks = await stream(client, fields)
        firsts = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls", []) if "id" in p]
        assert len(firsts) == 3 and len({p["id"] for p in firsts} | ids) == 6


async def test_the_openai_client_reads_the_calls():
    async with served(HERMES_TEXT, AUTO) as (client, _):
        async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused") as api:
            response = await api.chat.completions.create(model="stories", messages=USER, tools=TOOLS)
            message = response.choices[0].message
            assert message.content == "Let me check."
            assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
                [("get_weather", {"city": "Paris"}), ("get_time", {})]
            assert response.choices[0].finish_reason == "tool_calls"
            streamed = await api.chat.completions.create(model="stories", messages=USER, tools=TOOLS, stream=True)
            names = [c.function.name async for chunk in streamed for c in chunk.choices[0].delta.tool_calls or []
                     if c.function and c.function.name]
            assert names == ["get_weather", "get_time"]


@pytest.mark.parametrize("choice, text, calls", [
    ("required", REQUIRED_TEXT, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (NAMED, NAMED_TEXT, [("get_weather", {"city": "Paris"})]),
])
async def test_a_forced_call_beside_response_format_is_served_as_the_call(choice, text, calls):
    """The Agents SDK's pattern (an output type on every turn, tool_choice "required" on one): the call's grammar
    constrains the output, and the openai client reads the calls."""
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"]}}}
    async with served(text) as (client, engine):
        async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0) as api:
            response = await api.chat.completions.create(model="stories", messages=USER, tools=TOOLS,
                                                         tool_choice=choice, response_format=response_format)
    message = response.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == calls
    forced = tool_constraint(tool_use_of(msgspec.convert(TOOLS, list[Tool]), msgspec.convert(choice, ToolChoice),
                                         True, False))
    assert engine.submitted[0].sampling.structured == forced
