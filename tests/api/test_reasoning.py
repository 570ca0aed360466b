"""Reasoning models on /v1/chat/completions (--reasoning-parser): the thinking split from the answer as
`reasoning_content` (and vLLM's newer `reasoning`), whole and streamed; include_reasoning false; tool calls read
from the answer only; a structured output's grammar told to start after the end-of-thinking token; a prompt that
ended the thinking; and a model whose tokenizer has no think tokens (stories260K), served as plain content.

In process: the real application over a scripted engine (tests/fake_engine.py). stories260K's tokenizer has no
think tokens, so `think_model` is a copy of it with `<think>` (512) and `</think>` (513) added, as Qwen3's and
DeepSeek-R1's tokenizers have them (added, not special: their text shows in the output).
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import asynccontextmanager
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer

from shuttle.common.config import ApiConfig, IpcConfig, ShuttleConfig, ToolCallConfig
from shuttle.common.messages import FinishReason
from shuttle.common.model_config import ModelConfig
from shuttle.frontend.app import build_app
from shuttle.frontend.observability.metrics import Metrics
from shuttle.frontend.request.chat_template import ChatTemplate
from shuttle.frontend.state import FrontendState
from shuttle.frontend.tokenizer import TextTokenizer
from tests.fake_engine import TEMPLATES, FakeEngine
from tests.server import MODEL_DIR

CHAT = "/v1/chat/completions"
THINK, END_THINK, EOS = 512, 513, 2
USER = [{"role": "user", "content": "Is 7 prime?"}]
# A Qwen3-style prompt: enable_thinking false writes an empty, closed thinking into it
QWEN_TEMPLATE = ("{% for m in messages %}{{ m.role + ': ' }}{% if m.reasoning_content %}"
                 "{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}{{ m.content + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and not enable_thinking %}"
                 "<think>\\n\\n</think>\\n\\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def think_model(tmp_path_factory) -> Path:
    """stories260K with `<think>` and `</think>` added to its tokenizer (ids 512 and 513)."""
    directory = tmp_path_factory.mktemp("think_model")
    for source in MODEL_DIR.iterdir():
        shutil.copy(source, directory / source.name)
    spec = json.loads((directory / "tokenizer.json").read_text())
    for token_id, content in ((THINK, "<think>"), (END_THINK, "</think>")):
        spec["added_tokens"].append({"id": token_id, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "qwen.jinja").write_text(QWEN_TEMPLATE)
    return directory


def script(model_dir: Path, text: str) -> list[int]:
    """Token ids the fake engine generates for `text`, then end-of-sequence: each tag its one token, each text
    between tags as the tokenizer writes it except that its first word is spelled without the "▁" (a space) the
    tokenizer prepends to a text."""
    plain = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    for part in re.split(r"(</?think>)", text):
        if part in ("<think>", "</think>"):
            ids.append(plain.token_to_id(part))
        elif part:
            encoded = plain.encode(part, add_special_tokens=False).ids
            first = plain.id_to_token(encoded[0]).removeprefix("\u2581")
            ids += [plain.token_to_id(c) or plain.token_to_id(f"<0x{ord(c):02X}>") for c in first] + encoded[1:]
    return ids + [EOS]


@asynccontextmanager
async def served(model_dir: Path, text: str, parser: str | None = "deepseek_r1", template: str | None = None,
                 tool_calls: ToolCallConfig | None = None):
    """An in-process server of `model_dir` under --reasoning-parser `parser`, whose engine writes `text`; yields
    (test client, engine)."""
    engine = FakeEngine(script=script(model_dir, text), script_end=FinishReason.LENGTH)
    model = ModelConfig.from_dir(model_dir, served_model_name="stories")
    config = ShuttleConfig(model=model, ipc=IpcConfig("", "", "", ""),
                           chat_template=template or str(TEMPLATES / "stories_chat.jinja"),
                           api=ApiConfig(reasoning_parser=parser), tool_calls=tool_calls or ToolCallConfig())
    state = FrontendState(config, engine, TextTokenizer(model.model_dir),
                          ChatTemplate(model.model_dir, config.chat_template), Metrics(lambda: engine.stats))
    async with TestClient(TestServer(build_app(state, None))) as client:
        yield client, engine


async def post(client: TestClient, body: dict) -> dict:
    async with client.post(CHAT, json={"model": "stories", "messages": USER, **body}) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def stream(client: TestClient, body: dict) -> list[dict]:
    async with client.post(CHAT, json={"model": "stories", "messages": USER, "stream": True, **body}) as response:
        assert response.status == 200, await response.text()
        events = [line.decode().strip()[len("data: "):] async for line in response.content
                  if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


async def test_the_thinking_is_reasoning_content_and_the_answer_content(think_model):
    async with served(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, engine):
        body = await post(client, {})
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Yes, it is.", "reasoning": "Seven has no divisors.",
                       "reasoning_content": "Seven has no divisors."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.submitted[0].sampling.structured is None


async def test_a_stream_carries_the_thinking_and_the_answer_as_deltas(think_model):
    async with served(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, _):
        chunks = await stream(client, {})
    assert joined(chunks, "reasoning_content") == joined(chunks, "reasoning") == "Seven has no divisors."
    assert joined(chunks, "content") == "Yes, it is."
    # one token a chunk here: a delta carries thinking or answer, the thinking first, and never a tag
    kinds = [("reasoning" if "reasoning_content" in d else "content") for c in chunks[1:]
             if (d := c["choices"][0]["delta"]) and (d.get("reasoning_content") or d.get("content"))]
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning") and len(set(kinds)) == 2
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # the tags' own deltas released nothing: not sent (vLLM skips them too), unless they carry token ids
    assert all(c["choices"][0]["delta"] for c in chunks[:-1])
    async with served(think_model, "<think>Hmm.</think>Yes.") as (client, _):
        with_ids = await stream(client, {"return_token_ids": True})
    assert [c["choices"][0]["token_ids"] for c in with_ids[1:] if not c["choices"][0]["delta"]] == \
        [[THINK], [END_THINK], [EOS]]


async def test_a_thinking_cut_by_max_tokens_is_all_reasoning(think_model):
    async with served(think_model, "<think>Seven has no divisors. So yes.</think>Yes.") as (client, _):
        body = await post(client, {"max_tokens": 6})
        chunks = await stream(client, {"max_tokens": 6})
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == joined(chunks, "reasoning_content")
    assert message["reasoning_content"].startswith("Seven") and joined(chunks, "content") == ""
    assert body["choices"][0]["finish_reason"] == "length"


async def test_a_forced_call_cut_while_thinking_is_no_call(think_model):
    """A trial: a named tool_choice cut by max_tokens before </think> still showed a call with arguments "" (chat,
    every choice of n), a function_call item (Responses) and a tool_use block (Messages)."""
    tools = [{"type": "function", "function": {"name": "is_prime", "parameters": {"type": "object"}}}]
    forced = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "is_prime"}}, "max_tokens": 6}
    async with served(think_model, '<think>Seven has no divisors. So yes.</think>{"n": 7}',
                      template=str(TEMPLATES / "tools_chat.jinja")) as (client, _):
        body = await post(client, {**forced, "n": 2})
        chunks = await stream(client, forced)
        async with client.post("/v1/messages", json={
                "model": "stories", "max_tokens": 6, "messages": USER,
                "tools": [{"name": "is_prime", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "is_prime"}}) as response:
            message = await response.json()
        async with client.post("/v1/responses", json={
                "model": "stories", "input": "Is 7 prime?", "max_output_tokens": 6, "tool_choice": "required",
                "tools": [{"type": "function", "name": "is_prime", "parameters": {"type": "object"}}]}) as response:
            answer = await response.json()
    for choice in body["choices"]:
        assert "tool_calls" not in choice["message"] and choice["message"]["content"] is None
        assert choice["message"]["reasoning_content"].startswith("Seven") and choice["finish_reason"] == "length"
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks if c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [block["type"] for block in message["content"]] == ["thinking"] and message["stop_reason"] == "max_tokens"
    assert [item["type"] for item in answer["output"]] == ["reasoning"], answer


async def test_an_empty_thinking_is_none_whole_and_streamed(think_model):
    async with served(think_model, "<think></think>Yes.") as (client, _):
        body = await post(client, {})
        chunks = await stream(client, {})
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"], message["reasoning"]) == ("Yes.", None, None)
    assert joined(chunks, "content") == "Yes." and joined(chunks, "reasoning_content") == ""


async def test_include_reasoning_false_leaves_the_thinking_out(think_model):
    async with served(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, _):
        body = await post(client, {"include_reasoning": False, "logprobs": True})
        chunks = await stream(client, {"include_reasoning": False, "logprobs": True})
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"], message["reasoning"]) == ("Yes, it is.", None, None)
    assert joined(chunks, "content") == "Yes, it is."
    assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks if c["choices"])
    # logprobs would show the thinking's tokens: left out, as vLLM does
    assert body["choices"][0]["logprobs"] is None and all(c["choices"][0]["logprobs"] is None for c in chunks)


async def test_the_openai_client_reads_reasoning_content(think_model):
    async with served(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, _):
        openai_client = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x")
        completion = await openai_client.chat.completions.create(model="stories", messages=USER)
        await openai_client.close()
    message = completion.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("Yes, it is.", "Seven has no divisors.")


async def test_tool_calls_are_read_from_the_answer_only(think_model):
    hermes = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    call = '<tool_call>\n{"name": "is_prime", "arguments": {"n": 7}}\n</tool_call>'
    text = f"<think>I could write {call} here.</think>{call}"
    tools = [{"type": "function", "function": {"name": "is_prime", "parameters": {"type": "object"}}}]
    async with served(think_model, text, template=str(TEMPLATES / "tools_chat.jinja"), tool_calls=hermes) as \
            (client, _):
        body = await post(client, {"tools": tools})
        chunks = await stream(client, {"tools": tools})
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == f"I could write {call} here." and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("is_prime", {"n": 7})]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [t["function"].get("name") for t in streamed if "id" in t] == ["is_prime"]
    assert joined(chunks, "reasoning_content") == f"I could write {call} here."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


async def test_a_structured_output_starts_after_the_thinking(think_model):
    async with served(think_model, '<think>Seven has no divisors.</think>{"answer": true}') as (client, engine):
        body = await post(client, {"response_format": JSON_FORMAT})
        await post(client, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})
    assert [s.sampling.structured.starts_after for s in engine.submitted] == [END_THINK, END_THINK]
    assert json.loads(engine.submitted[0].sampling.structured.spec) == SCHEMA
    assert json.loads(body["choices"][0]["message"]["content"]) == {"answer": True}


async def test_qwen3_with_thinking_off_is_all_content_and_constrained_from_the_start(think_model):
    template = str(think_model / "qwen.jinja")
    async with served(think_model, '{"answer": true}', "qwen3", template) as (client, engine):
        body = await post(client, {"response_format": JSON_FORMAT, "chat_template_kwargs": {"enable_thinking": False}})
        on = await post(client, {"response_format": JSON_FORMAT})
    assert engine.submitted[0].prompt_token_ids[-6:].count(END_THINK) == 1  # the template closed the thinking
    assert [s.sampling.structured.starts_after for s in engine.submitted] == [None, END_THINK]
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ('{"answer": true}', None)
    assert (on["choices"][0]["message"]["content"], on["choices"][0]["message"]["reasoning_content"]) == \
        (None, '{"answer": true}')  # thinking on and no </think>: all of it was thinking


async def test_a_model_without_think_tokens_serves_plain_content():
    # the vLLM command line serves stories260K under --reasoning-parser deepseek_r1
    async with served(MODEL_DIR, "Once upon a time.") as (client, engine):
        body = await post(client, {"response_format": JSON_FORMAT})
        chunks = await stream(client, {})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Once upon a time."}
    assert engine.submitted[0].sampling.structured.starts_after is None  # constrained from the first token
    assert joined(chunks, "content") == "Once upon a time."
    assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks if c["choices"])


async def test_without_a_reasoning_parser_the_tags_are_content(think_model):
    async with served(think_model, "<think>Hmm.</think>Yes.", parser=None) as (client, _):
        body = await post(client, {})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "<think>Hmm.</think>Yes."}


# ---- the Responses API ---------------------------------------------------------------------------------------------

def thinking_tokens(model_dir: Path) -> int:
    """Tokens of the thinking of the responses below (between <think> and </think>)."""
    ids = script(model_dir, "<think>Seven has no divisors.</think>Yes, it is.")
    return ids.index(END_THINK) - ids.index(THINK) - 1


async def test_a_response_has_a_reasoning_item_before_its_message(think_model):
    async with served(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, _):
        openai_client = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x")
        response = await openai_client.responses.create(model="stories", input="Is 7 prime?")
        # the reasoning item sent back (as the Agents SDK does) or kept by the store is taken, not refused
        again = await openai_client.responses.create(model="stories", input=[
            *[item.model_dump(exclude_none=True) for item in response.output],
            {"role": "user", "content": "And 9?"}])
        follow = await openai_client.responses.create(model="stories", input="And 9?",
                                                      previous_response_id=response.id)
        await openai_client.close()
    reasoning, message = response.output
    assert (reasoning.type, [c.text for c in reasoning.content], reasoning.summary, reasoning.status) == \
        ("reasoning", ["Seven has no divisors."], [], "completed")
    assert reasoning.id.startswith("rs")
    assert (message.type, response.output_text) == ("message", "Yes, it is.")
    assert response.usage.output_tokens_details.reasoning_tokens == thinking_tokens(think_model)
    assert again.output_text == follow.output_text == "Yes, it is."


async def test_a_response_stream_has_reasoning_events(think_model):
    async with served(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, _):
        openai_client = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x")
        events = [e async for e in await openai_client.responses.create(model="stories", input="Is 7 prime?",
                                                                          stream=True)]
        await openai_client.close()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(e.delta for e in deltas) == "Seven has no divisors."
    assert {(e.output_index, e.content_index) for e in deltas} == {(0, 0)}
    opened = [k for k in kinds if k not in ("response.reasoning_text.delta", "response.output_text.delta")]
    assert opened == ["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added",
                      "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                      "response.output_item.added", "response.content_part.added",
                      "response.output_text.done", "response.content_part.done", "response.output_item.done",
                      "response.completed"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == "Seven has no divisors."
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert (final.output[0].content[0].text, final.output_text) == ("Seven has no divisors.", "Yes, it is.")
    assert final.usage.output_tokens_details.reasoning_tokens == thinking_tokens(think_model)


async def test_a_response_cut_inside_its_thinking_has_only_the_reasoning_item(think_model):
    """As OpenAI's reasoning models answer when max_output_tokens runs out while they think: the reasoning item,
    incomplete, and no message item (whole and streamed alike)."""
    async with served(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, _):
        openai_client = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x")
        response = await openai_client.responses.create(model="stories", input="Is 7 prime?", max_output_tokens=4)
        events = [e async for e in await openai_client.responses.create(model="stories", input="Is 7 prime?",
                                                                          max_output_tokens=4, stream=True)]
        await openai_client.close()
    final = events[-1].response
    for answer in (response, final):
        [reasoning] = answer.output
        assert (answer.status, reasoning.type, reasoning.status, answer.output_text) == \
            ("incomplete", "reasoning", "incomplete", "")
        assert reasoning.content[0].text and "Seven has no divisors.".startswith(reasoning.content[0].text)
    assert events[-1].type == "response.incomplete" and response.usage.output_tokens_details.reasoning_tokens == 3


async def test_usage_counts_the_thinking_tokens(think_model):
    async with served(think_model, "<think>Seven has no divisors.</think>Yes, it is.") as (client, _):
        body = await post(client, {"n": 2})
        chunks = await stream(client, {"stream_options": {"include_usage": True}})
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * thinking_tokens(think_model)}
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking_tokens(think_model)}
    async with served(MODEL_DIR, "Once upon a time.") as (client, _):
        assert "completion_tokens_details" not in (await post(client, {}))["usage"]  # no parser: no field


async def test_an_earlier_answers_thinking_reaches_the_template(think_model):
    history = [*USER, {"role": "assistant", "content": "Yes.", "reasoning_content": "No divisors."},
               {"role": "user", "content": "And 9?"}]
    async with served(think_model, "No.", "qwen3", str(think_model / "qwen.jinja")) as (client, engine):
        await post(client, {"messages": history})
        await post(client, {"messages": [*history[:1], {**history[1], "reasoning_content": None,
                                                        "reasoning": "No divisors."}, history[2]]})
    tokenizer = TextTokenizer(str(think_model))
    prompts = [tokenizer.decode(s.prompt_token_ids, skip_special_tokens=False) for s in engine.submitted]
    assert prompts[0] == prompts[1]
    ids = engine.submitted[0].prompt_token_ids
    assert (ids.count(THINK), ids.count(END_THINK)) == (1, 1)
    assert tokenizer.decode(ids[ids.index(THINK) + 1:ids.index(END_THINK)]) == "No divisors."
