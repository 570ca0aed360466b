"""Issue 27, tool calling end to end: the real processes on stories260K (which knows nothing of tools, so only the
grammar of tool_choice "required" or a named function makes it call one) through the official `openai` client,
LangChain's `bind_tools` / `with_structured_output` and the openai-agents SDK's `function_tool`."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "Tom asked about the weather."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def check_calls(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("seed", range(4))
def test_required_makes_a_call_that_follows_its_schema(client, seed):
    # one call (parallel_tool_calls false: the grammar's array ends after it); stories260K, free to go on, repeats
    # calls until max_tokens cuts the array
    response = client.chat.completions.create(model="stories260K", messages=USER, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
    choice = response.choices[0]
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_a_named_function_and_its_stream(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="stories260K", messages=USER, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    check_calls(whole.choices[0].message.tool_calls, ("get_weather",))
    arguments, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert finish == "tool_calls"


def test_auto_with_the_hermes_parser_answers(client):
    response = client.chat.completions.create(model="stories260K", messages=USER, tools=TOOLS, max_tokens=8,
                                              temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_langchain_bind_tools_and_with_structured_output(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # bounded: an unbounded integer runs to max_tokens
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model="stories260K", base_url=f"{server.url}/v1", api_key="none", temperature=0,
                     max_tokens=60, max_retries=0)
    bound = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    message = bound.invoke("Tom asked about the weather.")
    assert [c["name"] for c in message.tool_calls] and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Rome")

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = pydantic.Field(ge=0, le=8)

    # LangChain's methods json_schema (its default: response_format with strict) and function_calling (a named
    # tool_choice); its json_mode is response_format json_object, which stories260K fills with strings it never closes
    # within any max_tokens (tests/e2e/test_structured.py checks that form)
    for method in ("json_schema", "function_calling"):
        pet = llm.with_structured_output(Pet, method=method).invoke("Lily had a pet.")
        assert isinstance(pet, Pet), method
    free = llm.bind_tools([get_weather]).invoke("Tom asked about the weather.")  # tool_choice auto: hermes parser
    assert isinstance(free.content, str) and free.response_metadata["finish_reason"] in ("stop", "length")


def test_openai_agents_function_tool(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # bounded: an unbounded integer runs to max_tokens
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"


    async def run_agent():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as api:
            model = OpenAIChatCompletionsModel(model="stories260K", openai_client=api)
            agent = Agent(name="weather", instructions="Answer about the weather.", model=model, tools=[get_weather],
                          model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                       temperature=0, max_tokens=60),
                          tool_use_behavior="stop_on_first_tool")
            return await Runner.run(agent, "Tom asked about the weather.")
    result = asyncio.run(run_agent())
    assert seen and result.final_output == f"sunny in {seen[0]}"
