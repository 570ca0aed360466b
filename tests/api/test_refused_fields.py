"""Issue 27, "nothing silently ignored": every request field of OpenAI's or vLLM's schema that shuttle does not
implement, and every unknown field, gets 400 naming it (`param`) before any work is submitted, over HTTP
(completions, chat, /tokenize), the WebSocket and the ZeroMQ batch endpoint alike; a value that asks for what
shuttle does anyway, and OpenAI's metadata-only fields, are taken and change nothing.

In process: the real frontend app over a scripted fake engine (tests/inprocess.py), one server for the module."""

from __future__ import annotations

import json

import aiohttp
import msgspec
import pytest

from shuttle.common.messages import BatchRequest
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.request.decoding import REFUSED_FIELDS
from shuttle.frontend.request.protocol import ChatCompletionRequest, CompletionRequest
from tests.batch_wire import dealer, next_response
from tests.inprocess import start_app

C, CHAT = "/v1/completions", "/v1/chat/completions"
BASES = {C: {"prompt": "Hi", "max_tokens": 3}, CHAT: {"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 3}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}

# (field, value, endpoints): each refused with 400 and param == field
REFUSED = [
    # structured outputs are implemented (tests/unit/test_structured_request.py): a malformed one is refused
    ("response_format", {"type": "json_schema"}, (C, CHAT)),  # no json_schema
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "shema": SCHEMA}}, (C, CHAT)),  # typo
    ("response_format", {"type": "structural_tag"}, (C, CHAT)),
    ("structured_outputs", {"json": SCHEMA, "whitespace_pattern": " "}, (C, CHAT)),  # a vLLM option not implemented
    ("structured_outputs", {"regex": "a", "choice": ["yes", "no"]}, (C, CHAT)),  # two at once
    ("guided_json", "{not json", (C, CHAT)),
    ("guided_choice", [], (C, CHAT)),
    ("guided_regex", "", (C, CHAT)),
    ("guided_grammar", "", (C, CHAT)),
    ("guided_decoding_backend", "outlines", (C, CHAT)),
    ("guided_whitespace_pattern", " ", (C, CHAT)),
    ("structural_tag", "{}", (C, CHAT)),
    # tool calling is implemented (tests/api/test_tool_calling.py): malformed tools and choices are refused
    ("tools", [{"type": "function", "function": {"name": "get weather"}}], (CHAT,)),  # not a function name
    ("tool_choice", "required", (CHAT,)),  # without tools
    ("tool_choice", "auto", (CHAT,)),
    ("tool_choice", {"type": "function", "function": {"name": "get_weather"}}, (CHAT,)),
    ("parallel_tool_calls", "yes", (CHAT,)),
    ("functions", [TOOL["function"]], (CHAT,)),
    ("function_call", "auto", (CHAT,)),
    ("chat_template", "{{ messages[0]['content'] }}", (CHAT,)),
    ("allowed_token_ids", [1, 2, 3], (C, CHAT)),
    ("bad_words", ["dog"], (C, CHAT)),
    ("truncate_prompt_tokens", 2, (C, CHAT)),
    ("prompt_logprobs", -2, (C, CHAT)),  # implemented (tests/api/test_prompt_logprobs.py): -1 or k >= 0
    ("use_beam_search", True, (C, CHAT)),
    ("length_penalty", 0.5, (C, CHAT)),
    ("echo", True, (CHAT,)),
    ("skip_special_tokens", False, (C, CHAT)),
    ("logits_processors", ["x"], (C, CHAT)),
    ("reasoning_effort", "low", (CHAT,)),
    ("foo", 1, (C, CHAT)),  # unknown: refused as OpenAI does
    ("max_token", 4, (C,)),  # a typo of max_tokens
    ("max_completion_tokens", 4, (C,)),  # chat's field, not a completions one
    ("top_logprobs", 2, (C,)),
    ("prompt", "Hi", (CHAT,)),
]
CASES = [(path, field, value) for field, value, paths in REFUSED for path in paths]

# (field, value, endpoints): taken, and the request is submitted exactly as without it
ACCEPTED = [
    ("response_format", {"type": "text"}, (C, CHAT)),
    ("tools", [], (CHAT,)),
    ("tool_choice", "none", (CHAT,)),
    ("parallel_tool_calls", False, (CHAT,)),
    ("use_beam_search", False, (C, CHAT)),
    ("echo", False, (CHAT,)),
    ("skip_special_tokens", True, (C, CHAT)),
    ("chat_template_kwargs", {"enable_thinking": False}, (CHAT,)),  # implemented (frontend/request/chat_template.py)
    ("user", "u-1", (C, CHAT)),
    ("metadata", {"team": "search"}, (C, CHAT)),
    ("store", True, (C, CHAT)),
    ("service_tier", "auto", (C, CHAT)),
    ("safety_identifier", "hash-1", (C, CHAT)),
    ("prompt_cache_key", "k-1", (C, CHAT)),
]


# (fields, the constraint every choice is submitted with): accepted on both endpoints
CONSTRAINED = [
    ({"response_format": {"type": "json_object"}}, StructuredOutput(kind="json_object")),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            }
        },
        StructuredOutput(kind="json", spec=json.dumps(SCHEMA, separators=(",", ":"))),
    ),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput(kind="regex", spec="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(kind="choice", spec='["yes","no"]')),
    (
        {"guided_json": json.dumps(SCHEMA)},
        StructuredOutput(kind="json", spec=json.dumps(SCHEMA, separators=(",", ":"))),
    ),
    (
        {"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"},
        StructuredOutput(kind="grammar", spec='root ::= "a"'),
    ),
]
# (fields, param): each constraint is well formed, the request is not
MISCOMBINED = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "min_tokens": 1}, "min_tokens"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
]


@pytest.fixture(scope="module")
async def app():
    app = await start_app(batch=True)
    yield app
    await app.close()


def test_every_case_named_in_the_issue_is_covered():
    named = {
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_choice",
        "guided_regex",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "tool_choice",
        "functions",
        "function_call",
        "chat_template",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "use_beam_search",
        "echo",
        "tools",
    }
    assert named <= {field for field, _, _ in REFUSED}
    declared = CompletionRequest.__struct_fields__ + ChatCompletionRequest.__struct_fields__
    assert all(field in REFUSED_FIELDS or field in declared for field in named)


def check_refusal(status: int, body: dict, field: str) -> None:
    assert status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", field, 400), error
    assert field in error["message"]


@pytest.mark.parametrize(
    "path, field, value", CASES, ids=[f"{p.rsplit('/', 1)[1]}-{f}-{json.dumps(v)[:24]}" for p, f, v in CASES]
)
async def test_refused_over_http(app, path, field, value):
    submitted = len(app.engine.submitted)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{app.url}{path}", json={**BASES[path], field: value}) as response:
            check_refusal(response.status, await response.json(), field)
        # streaming changes nothing: refused with a status, not after a 200
        if path in (C, CHAT):
            async with session.post(f"{app.url}{path}", json={**BASES[path], field: value, "stream": True}) as response:
                check_refusal(response.status, await response.json(), field)
    assert len(app.engine.submitted) == submitted


async def test_messages_name_the_reason(app):
    async with aiohttp.ClientSession() as session:
        for body, words in (
            ({"guided_whitespace_pattern": " "}, "JSON whitespace is the grammar engine's own"),
            (
                {"structured_outputs": {"json": SCHEMA, "disable_fallback": True}},
                "structured_outputs.disable_fallback is not supported",
            ),
            ({"tools": [TOOL]}, "requires --enable-auto-tool-choice"),
            ({"functions": [TOOL["function"]]}, "use tools"),
            ({"foo": 1}, "Unrecognized request argument supplied: foo"),
        ):
            async with session.post(f"{app.url}{CHAT}", json={**BASES[CHAT], **body}) as response:
                assert response.status == 400 and words in (await response.json())["error"]["message"]


async def test_a_null_is_no_field(app):
    async with aiohttp.ClientSession() as session:
        for path in (C, CHAT):
            nulls = dict.fromkeys(f for f, _, paths in REFUSED if path in paths)
            async with session.post(f"{app.url}{path}", json={**BASES[path], **nulls}) as response:
                assert response.status == 200, await response.text()


@pytest.mark.parametrize("field, value, paths", ACCEPTED, ids=[f for f, _, _ in ACCEPTED])
async def test_accepted_and_changes_nothing(app, field, value, paths):
    async with aiohttp.ClientSession() as session:
        for path in paths:
            async with session.post(f"{app.url}{path}", json=BASES[path]) as response:
                plain = await response.json()
            async with session.post(f"{app.url}{path}", json={**BASES[path], field: value}) as response:
                assert response.status == 200, await response.text()
                given = await response.json()
            before, after = app.engine.submitted[-2:]
            assert (after.sampling, after.prompt_token_ids) == (before.sampling, before.prompt_token_ids)
            assert given["choices"] == plain["choices"]


async def test_tokenize_refuses_too(app):
    async with aiohttp.ClientSession() as session:
        for body, field in (
            ({"prompt": "Hi", "foo": 1}, "foo"),
            ({"messages": BASES[CHAT]["messages"], "chat_template": "{{ 1 }}"}, "chat_template"),
            ({"messages": BASES[CHAT]["messages"], "tool_choice": "auto"}, "tool_choice"),
        ):
            async with session.post(f"{app.url}/tokenize", json=body) as response:
                check_refusal(response.status, await response.json(), field)
        async with session.post(f"{app.url}/detokenize", json={"tokens": [1], "skip_special_tokens": False}) as r:
            check_refusal(r.status, await r.json(), "skip_special_tokens")


async def test_stream_options_refuses_unknown_keys(app):
    async with aiohttp.ClientSession() as session:
        body = {**BASES[C], "stream": True, "stream_options": {"include_usage": True, "not_an_option": True}}
        async with session.post(f"{app.url}{C}", json=body) as response:
            check_refusal(response.status, await response.json(), "stream_options")


async def test_refused_over_the_websocket(app):
    ws_cases = [(field, value) for path, field, value in CASES if path == C]
    submitted = len(app.engine.submitted)
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{app.url}/v1/ws") as ws:
        for i, (field, value) in enumerate(ws_cases):
            await ws.send_json({"type": "generate", "id": str(i), **BASES[C], field: value})
        ends = {}
        while len(ends) < len(ws_cases):
            frame = json.loads((await ws.receive(timeout=30)).data)
            ends[frame["id"]] = frame
        await ws.send_json({"type": "generate", "id": "ok", **BASES[C], "response_format": {"type": "text"}})
        done = json.loads((await ws.receive(timeout=30)).data)
        while done["type"] == "delta":
            done = json.loads((await ws.receive(timeout=30)).data)
    for i, (field, _) in enumerate(ws_cases):
        frame = ends[str(i)]
        assert frame["type"] == "error" and frame["error"]["param"] == field and frame["error"]["code"] == 400, frame
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 3
    assert len(app.engine.submitted) == submitted + 1


async def test_refused_over_the_batch_endpoint(app):
    sock = await dealer(app.batch.endpoint)
    submitted = len(app.engine.submitted)
    try:
        for i, (path, field, value) in enumerate(CASES):
            await sock.send(
                msgspec.msgpack.encode(BatchRequest(job_id=str(i), url=path, body={**BASES[path], field: value}))
            )
        results = {}
        for _ in CASES:
            result = await next_response(sock)
            results[result.job_id] = result
        for i, (_, field, _) in enumerate(CASES):
            check_refusal(results[str(i)].status_code, results[str(i)].body, field)
        # a msgpack map may have keys that are no strings: refused, not a 500
        await sock.send(msgspec.msgpack.encode(BatchRequest(job_id="int-key", url=C, body={**BASES[C], 7: 1})))
        result = await next_response(sock)
        assert result.status_code == 400, result.body
    finally:
        sock.close()
    assert len(app.engine.submitted) == submitted


async def test_openapi_document_takes_no_other_field(app):
    async with aiohttp.ClientSession() as session, session.get(f"{app.url}/openapi.json") as response:
        schemas = (await response.json())["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        schema = schemas[name]
        assert schema["additionalProperties"] is False
        assert not {"foo", "guided_whitespace_pattern"} & schema["properties"].keys()
        assert ("tool_choice" in schema["properties"]) == (name == "ChatCompletionRequest")
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["tools"]["anyOf"] == [
        {"type": "array", "items": {"$ref": "#/components/schemas/Tool"}},
        {"type": "null"},
    ]
    assert schemas["Tool"]["additionalProperties"] is False
    formats = chat["response_format"]["anyOf"][0]["anyOf"]
    assert [f["$ref"].rsplit("/", 1)[1] for f in formats] == [
        "ResponseFormatText",
        "ResponseFormatJsonObject",
        "ResponseFormatJsonSchema",
    ]
    assert (
        schemas["JsonSchemaFormat"]["required"] == ["name"]
        and schemas["JsonSchemaFormat"]["additionalProperties"] is False
    )
    outputs = schemas["StructuredOutputsFields"]
    assert outputs["additionalProperties"] is False and outputs["properties"]["whitespace_pattern"] == {"type": "null"}
    assert {
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "structured_outputs",
    } <= chat.keys()
    assert chat["echo"]["anyOf"][0] == {"const": False} and "echo" in schemas["CompletionRequest"]["properties"]
    assert {"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "user"} <= chat.keys()
    assert schemas["StreamOptions"]["additionalProperties"] is False


@pytest.mark.parametrize("fields, expected", CONSTRAINED, ids=[next(iter(f)) for f, _ in CONSTRAINED])
async def test_structured_outputs_are_submitted(app, fields, expected):
    async with aiohttp.ClientSession() as session:
        for path in (C, CHAT):
            async with session.post(f"{app.url}{path}", json={**BASES[path], **fields, "n": 2}) as response:
                assert response.status == 200, await response.text()
            assert [r.sampling.structured for r in app.engine.submitted[-2:]] == [expected, expected]


async def test_structured_outputs_over_the_websocket_and_the_batch_endpoint(app):
    fields, expected = CONSTRAINED[1]
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{app.url}/v1/ws") as ws:
        await ws.send_json({"type": "generate", "id": "s", **BASES[C], **fields})
        frame = json.loads((await ws.receive(timeout=30)).data)
        while frame["type"] == "delta":
            frame = json.loads((await ws.receive(timeout=30)).data)
    assert frame["type"] == "done", frame
    assert app.engine.submitted[-1].sampling.structured == expected
    sock = await dealer(app.batch.endpoint)
    try:
        await sock.send(msgspec.msgpack.encode(BatchRequest(job_id="s", url=CHAT, body={**BASES[CHAT], **fields})))
        result = await next_response(sock)
    finally:
        sock.close()
    assert result.status_code == 200, result.body
    assert app.engine.submitted[-1].sampling.structured == expected


@pytest.mark.parametrize("fields, param", MISCOMBINED, ids=[p for _, p in MISCOMBINED])
async def test_miscombined_constraints_are_refused(app, fields, param):
    submitted = len(app.engine.submitted)
    async with aiohttp.ClientSession() as session:
        for path in (C, CHAT):
            async with session.post(f"{app.url}{path}", json={**BASES[path], **fields}) as response:
                check_refusal(response.status, await response.json(), param)
    assert len(app.engine.submitted) == submitted
