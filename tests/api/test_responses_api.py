"""Issue 28, POST /v1/responses (OpenAI's Responses API) on the chat machinery.

In process (the real application over the scripted engine, tests/fake_engine.py): the response object's exact
shape, input items as chat messages (the same prompt as the equivalent chat request), tools and text.format as the
chat constraint, the refusals (status and param), the stream's event order and that its deltas make the whole text,
and the official `openai` client, LangChain's use_responses_api and the openai-agents SDK's default model over it.
End to end on the shared `server` (stories260K): greedy output equal to the chat endpoint's, streamed or not,
`responses.parse` under the grammar and an agent run.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Literal

import msgspec
import openai
import pydantic
import pytest
from aiohttp.test_utils import TestClient

from shuttle.common.config import ToolCallConfig
from shuttle.common.messages import FinishReason
from shuttle.common.sampling import StructuredOutput
from tests.api.test_api_details import PROMPT, STORY, STORY_TEXT, openai_client, post, served
from tests.api.test_tool_calling import NAMED_TEXT, REQUIRED_TEXT, script
from tests.fake_engine import FakeEngine

URL = "/v1/responses"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "get_time"}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                "parameters": WEATHER, "strict": True}},
              {"type": "function", "function": {"name": "get_time"}}]


@asynccontextmanager
async def served_tools(text: str, template: str = "tools_chat.jinja", **config):
    """An in-process server (with the tools chat template) whose engine writes `text`."""
    engine = FakeEngine(script=script(text), script_end=FinishReason.LENGTH)
    async with served(engine, template=template, **config) as (client, engine):
        yield client, engine


async def events_of(client: TestClient, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a streamed response; the stream has no [DONE]."""
    async with client.post(URL, json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = (await response.read()).decode()
    out = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    for i, (name, data) in enumerate(out):
        assert data["type"] == name and data["sequence_number"] == i
    return out


# ---- the response object ---------------------------------------------------------------------------------------

async def test_a_string_input_answers_one_message_item_with_usage_and_the_echoed_fields():
    async with served() as (client, engine):
        status, body = await post(client, URL, {"model": "stories", "input": PROMPT, "temperature": 0.5,
                                                "top_p": 0.9, "metadata": {"k": "v"}, "user": "u", "store": True})
        _, chat = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})
    assert status == 200, body
    assert body["id"].startswith("resp_") and isinstance(body["created_at"], int)
    [item] = body["output"]
    assert item["id"].startswith("msg_")
    assert item == {"type": "message", "id": item["id"], "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": STORY_TEXT, "annotations": [], "logprobs": []}]}
    assert chat["choices"][0]["message"]["content"] == STORY_TEXT
    assert engine.submitted[0].prompt_token_ids == engine.submitted[1].prompt_token_ids
    prompt = len(engine.submitted[0].prompt_token_ids)
    generated = len(STORY) + 1  # and the end-of-sequence token
    assert body["usage"] == {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
                             "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}
    expected = {"object": "response", "status": "completed", "background": False, "error": None,
                "incomplete_details": None, "instructions": None, "max_output_tokens": None,
                "metadata": {"k": "v"}, "model": "stories", "parallel_tool_calls": True,
                "previous_response_id": None, "reasoning": None, "store": True, "temperature": 0.5,
                "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "top_p": 0.9,
                "truncation": "disabled", "user": "u"}
    assert {k: body[k] for k in expected} == expected
    assert set(body) == set(expected) | {"id", "created_at", "output", "usage"}
    sampling = engine.submitted[0].sampling
    assert (sampling.temperature, sampling.top_p) == (0.5, 0.9)


async def test_cut_by_max_output_tokens_is_incomplete():
    async with served() as (client, engine):
        status, body = await post(client, URL, {"input": PROMPT, "max_output_tokens": 3, "seed": 7})
    assert status == 200, body
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["max_output_tokens"] == 3
    assert body["usage"]["output_tokens"] == 3
    assert engine.submitted[0].sampling.max_tokens == 3 and engine.submitted[0].sampling.seed == 7


async def test_instructions_and_input_items_are_the_chat_messages():
    """instructions first as a system message; a message's content as a string or input_text/output_text parts;
    function_call items an assistant's tool_calls, function_call_output items tool messages: the same prompt as the
    chat request that says the same."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                          {"type": "input_text", "text": "in Paris?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
             {"role": "developer", "content": "Answer briefly."}]
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
                {"role": "developer", "content": "Answer briefly."}]
    async with served_tools("Sunny.") as (client, engine):
        status, body = await post(client, URL, {"instructions": "You are terse.", "input": items,
                                                "tools": TOOLS[1:], "tool_choice": "none"})
        assert status == 200, body
        status, chat = await post(client, "/v1/chat/completions", {"messages": messages, "tools": CHAT_TOOLS[1:],
                                                                   "tool_choice": "none"})
        assert status == 200, chat
    assert engine.submitted[0].prompt_token_ids == engine.submitted[1].prompt_token_ids
    assert body["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert body["instructions"] == "You are terse." and body["tools"][0]["name"] == "get_time"


# ---- tools and text.format -------------------------------------------------------------------------------------

async def test_a_named_function_is_one_function_call_item_under_its_grammar():
    async with served_tools(NAMED_TEXT) as (client, engine):
        status, body = await post(client, URL, {"input": "Weather?", "tools": TOOLS,
                                                "tool_choice": {"type": "function", "name": "get_weather"}})
        events = await events_of(client, {"input": "Weather?", "tools": TOOLS,
                                          "tool_choice": {"type": "function", "name": "get_weather"}})
    assert status == 200, body
    [call] = body["output"]
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call == {"type": "function_call", "id": call["id"], "call_id": call["call_id"], "name": "get_weather",
                    "arguments": NAMED_TEXT, "status": "completed"}
    assert body["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert body["tools"] == [{"type": "function", "name": "get_weather", "description": "Current weather",
                              "parameters": WEATHER, "strict": True},
                             {"type": "function", "name": "get_time", "description": None, "parameters": None,
                              "strict": None}]
    constraint = engine.submitted[0].sampling.structured
    assert constraint == StructuredOutput(kind="json", spec=msgspec.json.encode(WEATHER).decode())
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(names[3:-3]) == {"response.function_call_arguments.delta"}
    deltas = "".join(data["delta"] for name, data in events if name == "response.function_call_arguments.delta")
    done = events[-3][1]
    assert deltas == done["arguments"] == NAMED_TEXT and done["name"] == "get_weather"
    streamed = events[-1][1]["response"]["output"]
    assert [(i["type"], i["name"], i["arguments"], i["status"]) for i in streamed] == \
        [("function_call", "get_weather", NAMED_TEXT, "completed")]


async def test_required_calls_are_function_call_items_in_order():
    async with served_tools(REQUIRED_TEXT) as (client, engine):
        status, body = await post(client, URL, {"input": "Weather?", "tools": TOOLS, "tool_choice": "required"})
        events = await events_of(client, {"input": "Weather?", "tools": TOOLS, "tool_choice": "required"})
    assert status == 200, body
    assert [(i["type"], i["name"], json.loads(i["arguments"])) for i in body["output"]] == \
        [("function_call", "get_weather", {"city": "Paris"}), ("function_call", "get_time", {})]
    assert len({i["call_id"] for i in body["output"]}) == 2
    assert engine.submitted[0].sampling.structured.kind == "json"
    final = events[-1][1]["response"]["output"]
    assert [(i["name"], i["arguments"]) for i in final] == [(i["name"], i["arguments"]) for i in body["output"]]
    added = [data["output_index"] for name, data in events if name == "response.output_item.added"]
    assert added == [0, 1]


async def test_required_calls_beside_a_text_format_are_served_as_the_calls():
    """The Agents SDK sends its output type (text.format) with tool_choice "required": the calls are served."""
    text_format = {"format": {"type": "json_schema", "name": "answer",
                              "schema": {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}},
                                         "required": ["mood"]}}}
    async with served_tools(REQUIRED_TEXT) as (client, engine):
        status, body = await post(client, URL, {"input": "Weather?", "tools": TOOLS, "tool_choice": "required",
                                                "text": text_format})
    assert status == 200, body
    assert [(i["type"], i["name"]) for i in body["output"]] == [("function_call", "get_weather"),
                                                                ("function_call", "get_time")]
    assert '"parameters"' in engine.submitted[0].sampling.structured.spec  # the calls' grammar, not the format's


async def test_auto_with_a_parser_gives_text_then_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    async with served_tools(text, tool_calls=ToolCallConfig(enable_auto_tool_choice=True,
                                                             tool_call_parser="hermes")) as (client, _):
        status, body = await post(client, URL, {"input": "Weather?", "tools": TOOLS})
        events = await events_of(client, {"input": "Weather?", "tools": TOOLS})
    assert status == 200, body
    assert [i["type"] for i in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0]["text"].strip() == "Let me check."
    assert json.loads(body["output"][1]["arguments"]) == {"city": "Paris"}
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    streamed_text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert streamed_text == final["output"][0]["content"][0]["text"] == body["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("form, constraint", [
    ({"type": "json_object"}, StructuredOutput(kind="json_object")),
    ({"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True},
     StructuredOutput(kind="json", spec=msgspec.json.encode(WEATHER).decode())),
    ({"type": "text"}, None),
])
async def test_text_format_is_the_output_constraint(form, constraint):
    async with served() as (client, engine):
        status, body = await post(client, URL, {"input": PROMPT, "text": {"format": form}})
    assert status == 200, body
    assert engine.submitted[0].sampling.structured == constraint
    assert body["text"] == {"format": form if form["type"] != "json_schema" else {**form, "description": None}}


# ---- refusals --------------------------------------------------------------------------------------------------

REFUSALS = [
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True, "store": False}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "bad name", "schema": WEATHER}}}, "text"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "strange": 1}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" (the default with tools) on a server without a tool-call parser
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": 5}, "input"),
]


@pytest.mark.parametrize("arguments", ["[1]", "{", "null"])
async def test_a_function_call_item_with_bad_arguments_is_named_as_its_input_item(arguments):
    call = {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": arguments}
    async with served() as (client, engine):
        status, body = await post(client, URL, {"input": [{"role": "user", "content": "Weather?"}, call]})
    assert (status, body["error"]["param"]) == (400, "input") and engine.submitted == []
    assert body["error"]["message"] == "input[1].arguments must be a JSON object as text"


@pytest.mark.parametrize("fields, param, words", [
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strng"}}}}, "text",
     "text.format.schema at /type: `type` must be one of"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text", "text.format.name must be"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "strng"}}], "tool_choice": "required"},
     "tools", "tools[0].parameters at /type: `type` must be one of"),
])
async def test_the_chat_checks_name_the_responses_fields(fields, param, words):
    """A trial: these said response_format.json_schema.schema and tools[0].function.parameters."""
    async with served() as (client, engine):
        status, body = await post(client, URL, {"input": PROMPT, **fields})
    assert (status, body["error"]["param"]) == (400, param) and words in body["error"]["message"], body
    assert "response_format" not in body["error"]["message"] and "function." not in body["error"]["message"]


@pytest.mark.parametrize("fields, param", REFUSALS)
async def test_what_is_not_served_is_refused_by_name(fields, param):
    async with served() as (client, engine):
        status, body = await post(client, URL, {"input": PROMPT, **fields})
        stream_status, _ = await post(client, URL, {"input": PROMPT, **fields, "stream": True})
    assert status == 400 and body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error"
    assert stream_status == 400 and engine.submitted == []


async def test_accepted_values_of_refused_fields_and_null_as_the_default():
    async with served() as (client, _):
        status, body = await post(client, URL, {"input": PROMPT, "include": [], "background": False,
                                                "truncation": "disabled", "store": True, "tools": [],
                                                "tool_choice": "auto", "parallel_tool_calls": False,
                                                "previous_response_id": None, "reasoning": None,
                                                "instructions": None, "temperature": None, "text": None,
                                                "service_tier": "auto", "safety_identifier": "s",
                                                "prompt_cache_key": "k"})
        assert status == 200, body
        status, missing = await post(client, URL, {"model": "gpt-4", "input": PROMPT})
    assert status == 404 and missing["error"]["param"] == "model"


async def test_an_engine_refusal_before_the_first_event_is_an_http_status():
    async with served(FakeEngine(error=(503, "queue full"))) as (client, _):
        async with client.post(URL, json={"input": PROMPT, "stream": True}) as response:
            assert response.status == 503
            assert (await response.json())["error"]["message"] == "queue full"


# ---- the stream ------------------------------------------------------------------------------------------------

async def test_the_stream_events_in_order_and_their_deltas_make_the_whole_text():
    async with served() as (client, _):
        _, whole = await post(client, URL, {"input": PROMPT, "instructions": "Tell a story."})
        events = await events_of(client, {"input": PROMPT, "instructions": "Tell a story."})
    names = [name for name, _ in events]
    deltas = names.count("response.output_text.delta")
    assert deltas > 1
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    item_id = events[2][1]["item"]["id"]
    assert events[2][1]["item"] == {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress",
                                    "content": []}
    assert events[3][1]["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert all(data["item_id"] == item_id and data["output_index"] == 0 and data["content_index"] == 0
               for name, data in events[3:-2])
    assert text == events[-4][1]["text"] == whole["output"][0]["content"][0]["text"] == STORY_TEXT
    final = events[-1][1]["response"]
    assert final["id"] == created["id"] and final["status"] == "completed"
    assert {k: v for k, v in final.items() if k not in ("id", "created_at", "output")} == \
        {k: v for k, v in whole.items() if k not in ("id", "created_at", "output")}
    assert final["output"][0]["content"] == whole["output"][0]["content"]


async def test_a_stream_cut_by_length_ends_with_response_incomplete():
    async with served() as (client, _):
        events = await events_of(client, {"input": PROMPT, "max_output_tokens": 4})
    name, data = events[-1]
    assert name == "response.incomplete" and data["response"]["status"] == "incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2][1]["item"]["status"] == "incomplete"


# ---- clients over the in-process server ------------------------------------------------------------------------

async def test_the_openai_client_create_stream_and_parse():
    async with served() as (client, _):
        responses = openai_client(client).responses
        whole = await responses.create(model="stories", input=PROMPT)
        assert whole.output_text == STORY_TEXT and whole.status == "completed"
        async with responses.stream(model="stories", input=PROMPT) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
        assert final.output_text == STORY_TEXT
        text = ""
        async for event in await responses.create(model="stories", input=PROMPT, stream=True):
            if event.type == "response.output_text.delta":
                text += event.delta
        assert text == STORY_TEXT


async def test_langchain_use_responses_api_invokes_and_streams():
    from langchain_openai import ChatOpenAI

    async with served() as (client, _):
        llm = ChatOpenAI(model="stories", base_url=str(client.make_url("/v1")), api_key="none", max_retries=0,
                         use_responses_api=True, temperature=0, max_tokens=64)
        message = await llm.ainvoke("Hi")
        streamed = [chunk async for chunk in llm.astream("Hi")]
    assert message.text == STORY_TEXT and message.usage_metadata["output_tokens"] == len(STORY) + 1
    assert "".join(chunk.text for chunk in streamed) == STORY_TEXT


async def test_the_agents_sdk_round_trip_through_a_function_call():
    """OpenAIResponsesModel (the SDK's default model): turn 1, tool_choice "required" makes a function_call item;
    the SDK runs the tool and sends the call and its output back as input items; turn 2 (the SDK resets tool_choice,
    so "auto" with the hermes parser) reads the same script as text, the final output."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    auto = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    # the plain template: the SDK's tools and the history in the tools template would not fit stories260K's context
    async with served_tools(text, "stories_chat.jinja", tool_calls=auto) as (client, engine):
        model = OpenAIResponsesModel(model="stories", openai_client=openai_client(client, max_retries=0))
        agent = Agent(name="weather", instructions="Answer about the weather.", model=model, tools=[get_weather],
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                   temperature=0, max_tokens=60))
        result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    assert seen == ["Paris"]
    assert result.final_output.strip() == text
    assert len(engine.submitted) == 2 and engine.submitted[1].sampling.structured is None


# ---- end to end on stories260K ---------------------------------------------------------------------------------

def test_greedy_output_equals_the_chat_endpoints_streamed_or_not(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    kwargs = dict(model="stories260K", input="Once upon a time", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model="stories260K", max_tokens=16, temperature=0,
                                          messages=[{"role": "user", "content": "Once upon a time"}])
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(**kwargs) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    created = "".join(e.delta for e in client.responses.create(**kwargs, stream=True)
                      if e.type == "response.output_text.delta")
    assert created == whole.output_text


def test_parse_follows_the_pydantic_model_under_the_grammar(server):
    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = pydantic.Field(ge=0, le=8)

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    response = client.responses.parse(model="stories260K", input="Lily had a pet.", text_format=Pet,
                                      max_output_tokens=60, temperature=0)
    assert response.status == "completed" and isinstance(response.output_parsed, Pet)


def test_an_openai_agents_run_to_a_final_output(server):
    """The SDK treats a response cut by max_output_tokens as a failure, and stories260K's stories are long: the
    agent's output type makes the grammar end the output."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    class Answer(pydantic.BaseModel):
        mood: Literal["happy", "sad"]

    set_tracing_disabled(True)

    async def run_agent():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as api:
            model = OpenAIResponsesModel(model="stories260K", openai_client=api)
            agent = Agent(name="storyteller", instructions="Answer in one word.", model=model, output_type=Answer,
                          model_settings=ModelSettings(temperature=0, max_tokens=60))
            return await Runner.run(agent, "Hi", max_turns=2)
    result = asyncio.run(run_agent())
    assert isinstance(result.final_output, Answer)
