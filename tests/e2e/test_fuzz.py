"""Issue 9 acceptance 4: property-based fuzzing of every endpoint, the WebSocket and the batch socket of a real
server, driven by its own /openapi.json. Request bodies are drawn from the document's JSON Schemas (with any
field liable to hold any JSON value instead), plus raw bytes, wrong content types and unknown paths. Each
hypothesis example sends FUZZ_BATCH cases at once; FUZZ_EXAMPLES examples make the CI-sized run
(SHUTTLE_FUZZ_EXAMPLES raises it). Every case must get an answer that is not a 5xx within HANG seconds, every
WebSocket generate exactly one terminal frame and every batch message a result; afterwards no process has died
or restarted and a greedy request is token-exact.
"""

import asyncio
import json
import os

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shuttle.common.messages import BatchHeartbeat, BatchServerMessage
from tests.client import post_completion
from tests.conftest import hf_greedy
from tests.malformed import malformed_batch_frames
from tests.server import pid_alive

HANG = 60.0
FUZZ_BATCH = 25
FUZZ_EXAMPLES = int(os.environ.get("SHUTTLE_FUZZ_EXAMPLES", "60"))  # x FUZZ_BATCH = 1,500 cases

any_text = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=5)
WRONG = st.sampled_from([None, "", "x", -1, 0, 1.5, 2**70, -2**70, float("inf"), [], {}, [1], {"a": 1}, True])


_STRATEGIES: dict[str, st.SearchStrategy] = {}


def from_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """A strategy for values of a msgspec-made JSON Schema (object, anyOf, $ref, scalars, arrays; {} is any).
    Built once per schema: hypothesis validates each new strategy object, which would dominate the run."""
    key = json.dumps(schema, sort_keys=True)
    if key not in _STRATEGIES:
        _STRATEGIES[key] = _from_schema(schema, components)
    return _STRATEGIES[key]


def _from_schema(schema: dict, components: dict) -> st.SearchStrategy:
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        fields = {name: st.one_of(from_schema(sub, components), WRONG)  # sometimes the wrong type
                  for name, sub in schema["properties"].items()}
        required = {name: fields.pop(name) for name in schema.get("required", []) if name in fields}
        return st.fixed_dictionaries(required, optional=fields)
    if kind == "array":
        return st.lists(from_schema(schema["items"], components) if "items" in schema else json_values, max_size=6)
    return {
        "string": st.one_of(st.text(max_size=24), any_text),
        "integer": st.one_of(st.integers(-3, 20), st.integers()),
        "number": st.one_of(st.floats(-3, 3), st.floats(allow_nan=False)),
        "boolean": st.booleans(),
        "null": st.none(),
        "object": st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    }.get(kind, json_values)


def bounded(body):
    """Valid requests must stay cheap: unless the fuzzer chose otherwise, few tokens and a short timeout."""
    if isinstance(body, dict):
        body.setdefault("max_tokens", 4)
        if body.get("max_tokens") is None:
            body["max_tokens"] = 4
        body.setdefault("timeout", 5)
    return body


@pytest.fixture(scope="module")
def fuzz_server(server):
    """The suite's shared server: whatever the fuzzer sends, the tests after it must still be served."""
    return server


@pytest.fixture(scope="module")
def schema(fuzz_server):
    import urllib.request
    with urllib.request.urlopen(f"{fuzz_server.url}/openapi.json", timeout=HANG) as response:
        return json.load(response)


def _same(body):
    return body


def _generates(path: str) -> bool:
    return path.startswith("/v1/") or path == "/invocations"


def http_cases(document: dict) -> st.SearchStrategy:
    components = document["components"]["schemas"]
    posts = [(path, op["post"]["requestBody"]["content"]["application/json"]["schema"])
             for path, op in document["paths"].items() if "requestBody" in op.get("post", {})]
    gets = [path for path, op in document["paths"].items() if "get" in op and path != "/v1/ws"]
    # only the generating endpoints (and /invocations, which routes to them) take max_tokens and timeout (any other
    # field is refused, as unknown); a POST that takes no body (/ping) is drawn among `anything` only
    typed = st.one_of([st.tuples(st.just("POST"), st.just(path),
                                 from_schema(ref, components).map(bounded if _generates(path) else _same),
                                 st.just("application/json")) for path, ref in posts])
    anything = st.tuples(st.sampled_from(["POST", "GET", "PUT", "DELETE"]),
                         st.sampled_from([p for p, _ in posts] + gets + ["/", "/v1/nothing", "/v1/completions/x"]),
                         st.one_of(json_values, st.binary(max_size=64)),
                         st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]))
    return st.one_of(typed, typed, anything)


def ws_frames(document: dict) -> st.SearchStrategy:
    components = document["components"]["schemas"]
    head = st.fixed_dictionaries({"type": st.sampled_from(["generate", "cancel", "other"]),
                                  "id": st.one_of(any_text, json_values)})
    generate = st.tuples(from_schema(components["CompletionRequest"], components), head).map(
        lambda parts: bounded({**parts[0], **parts[1]}))
    return st.one_of(generate, generate, json_values, st.text(max_size=40))


def _pack(value) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:  # an integer msgpack cannot carry: send its text instead
        return msgspec.msgpack.encode(repr(value))
    except UnicodeEncodeError:  # a lone surrogate, which UTF-8 cannot carry: send the string's valid part
        return _pack(_without_surrogates(value))


def _without_surrogates(value):
    """`value` with every string's lone surrogates replaced by U+FFFD (a msgpack str is UTF-8)."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if isinstance(value, dict):
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    return value


def batch_messages() -> st.SearchStrategy:
    body = st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 600),
                                                                                     max_size=8))},
                                 optional={"max_tokens": st.integers(-2, 6), "temperature": st.floats(-1, 3),
                                           "top_k": st.integers(-3, 3), "stop": st.lists(st.text(max_size=4),
                                                                                          max_size=3)})
    request = st.fixed_dictionaries({"type": st.just("request"), "job_id": st.text(max_size=8),
                                     "url": st.sampled_from(["/v1/completions", "/v1/chat/completions", "/x"]),
                                     "body": st.one_of(body, json_values)})
    encoded = request.map(lambda r: [_pack(r)])
    # garbage frames and frame counts too, and every malformed kind of issue 24 (deep nesting, unknown tags, ...)
    return st.one_of(encoded, encoded, st.lists(st.binary(max_size=24), min_size=1, max_size=3),
                     json_values.map(lambda v: [_pack(v)]), malformed_batch_frames())


async def send_http(session, url, case) -> None:
    method, path, body, content_type = case
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.request(method, f"{url}{path}", data=data, headers={"Content-Type": content_type}) as response:
        await response.read()
        assert response.status < 500, (case, response.status, await response.text())


async def send_ws(session, url, frames) -> None:
    async with session.ws_connect(f"{url}/v1/ws") as ws:
        generating = 0
        for frame in frames:
            await ws.send_str(frame if isinstance(frame, str) else json.dumps(frame))
            generating += isinstance(frame, dict) and frame.get("type") == "generate"
        answers = []
        while generating:  # every generate (even a rejected one) ends with one done or error frame
            message = await ws.receive(timeout=HANG)
            assert message.type == aiohttp.WSMsgType.TEXT, (frames, message)
            answer = json.loads(message.data)
            answers.append(answer)
            if answer["type"] in ("done", "error") and answer["id"] is not None:
                generating -= 1
            assert answer["type"] != "error" or answer["error"]["code"] < 500, (frames, answer)


async def send_batch(endpoint, messages) -> None:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for frames in messages:
            await sock.send_multipart(frames)
        answered = 0
        while answered < len(messages):  # one result per message, however malformed (heartbeats aside)
            result = msgspec.msgpack.decode(await asyncio.wait_for(sock.recv(), HANG), type=BatchServerMessage)
            if isinstance(result, BatchHeartbeat):
                continue
            answered += 1
            assert result.status_code < 500, (messages, result)
    finally:
        sock.close()


def test_fuzz_every_endpoint_the_websocket_and_the_batch_socket(fuzz_server, schema):
    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(_session())
    cases = st.lists(st.one_of(
        http_cases(schema).map(lambda c: ("http", c)), http_cases(schema).map(lambda c: ("http", c)),
        st.lists(ws_frames(schema), min_size=1, max_size=4).map(lambda f: ("ws", f)),
        st.lists(batch_messages(), min_size=1, max_size=3).map(lambda m: ("batch", m))),
        min_size=FUZZ_BATCH, max_size=FUZZ_BATCH)
    count = [0]

    # No shrinking: each example is FUZZ_BATCH requests to a live server, and a failing case names itself in its
    # assertion message anyway.
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases)
    def run(batch):
        async def one(kind, case):
            if kind == "http":
                await send_http(session, fuzz_server.url, case)
            elif kind == "ws":
                await send_ws(session, fuzz_server.url, case)
            else:
                await send_batch(fuzz_server.batch_endpoint, case)
        async def all_of_them():
            await asyncio.wait_for(asyncio.gather(*(one(*c) for c in batch)), HANG)

        loop.run_until_complete(all_of_them())
        count[0] += len(batch)

    try:
        run()
        print(f"fuzzed {count[0]} cases")
        assert count[0] >= FUZZ_EXAMPLES * FUZZ_BATCH
        assert fuzz_server.restarts == 0 and all(pid_alive(p) for p in fuzz_server.all_pids)
        ids = [1, 403, 407, 261, 378]
        status, body = loop.run_until_complete(post_completion(
            session, fuzz_server.url, prompt=ids, max_tokens=24, temperature=0, return_token_ids=True))
        assert status == 200 and body["choices"][0]["token_ids"] == hf_greedy(ids, 24)
    finally:
        loop.run_until_complete(session.close())
        loop.close()


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=HANG))
