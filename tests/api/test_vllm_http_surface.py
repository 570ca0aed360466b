"""Issue 43, the HTTP surface a vLLM deployment reaches: SageMaker's /ping and /invocations, /load, /tokenizer_info,
--root-path, --uds, --enable-request-id-headers, --disable-fastapi-docs and --uvicorn-log-level, each in process
(the real aiohttp application over the scripted engine)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from shuttle.common.config import ApiConfig, OpsConfig
from shuttle.common.messages import FinishReason
from shuttle.frontend.web.root_path import normalize_root_path
from shuttle.frontend.web.sagemaker import route_of
from shuttle.frontend.web.server import access_logger, listen, listen_url, remove_socket_file
from shuttle.frontend.web.tokenizer_info import tokenizer_info
from shuttle.launcher.commands import _frontend_listens
from tests.api.test_api_details import PROMPT, STORY, STORY_TEXT, USER, post, served
from tests.fake_engine import TEMPLATES, FakeEngine, frontend_app
from tests.inprocess import make_config

KEY = "Secret-Key"
WITH_KEY = {"Authorization": f"Bearer {KEY}"}


# ---- SageMaker: /ping and /invocations ---------------------------------------------------------------------------

async def test_ping_answers_as_health_on_get_and_post_without_the_key():
    async with served(api_key=KEY) as (client, _):
        async with client.get("/health") as response:
            health = response.status, await response.json()
        for method in ("GET", "POST"):
            async with client.request(method, "/ping") as response:
                assert (response.status, await response.json()) == health, method
    assert health[0] == 200 and health[1]["status"] == "ok"


async def test_ping_says_draining_as_health_does():
    engine = FakeEngine(script=list(STORY))
    async with served(engine) as (client, _):
        engine.draining = True
        async with client.get("/ping") as response:
            assert response.status == 503 and (await response.json())["status"] == "draining"


async def test_invocations_routes_messages_to_chat_and_prompt_to_completions():
    async with served(api_key=KEY) as (client, engine):
        status, chat = await post(client, "/invocations", {"messages": USER, "max_tokens": 3}, headers=WITH_KEY)
        assert (status, chat["object"], chat["choices"][0]["message"]["role"]) == (200, "chat.completion", "assistant")
        status, completion = await post(client, "/invocations", {"prompt": PROMPT, "max_tokens": 30},
                                        headers=WITH_KEY)
        assert (status, completion["object"], completion["choices"][0]["text"]) == (200, "text_completion",
                                                                                     STORY_TEXT)
        # both fields: a chat, as vLLM tries the chat request first
        status, both = await post(client, "/invocations", {"messages": USER, "prompt": PROMPT, "max_tokens": 2},
                                  headers=WITH_KEY)
        assert status == 400 and both["error"]["param"] == "prompt"  # then the chat endpoint's own check
        async with client.post("/invocations", json={"prompt": PROMPT, "max_tokens": 3, "stream": True},
                               headers=WITH_KEY) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            events = [line async for line in response.content if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n" and json.loads(events[0][6:])["object"] == "text_completion"
        status, refused = await post(client, "/invocations", {"prompt": PROMPT})
        assert status == 401, refused  # inference needs the key, as every route but the probes
    assert len(engine.submitted) == 3


@pytest.mark.parametrize("body, message", [
    (b'{"input": "Hi", "max_tokens": 2}', "this body has neither"),
    (b'{"max_tokens": 2}', "this body has neither"),
    # vLLM routes on the key: the endpoint it names reports the null
    (b'{"prompt": null, "max_tokens": 2}', "prompt is required"),
    (b'{"messages": null, "max_tokens": 2}', "missing required field `messages`"),
    (b'[{"prompt": "Hi"}]', "POST /invocations takes a JSON object"),
    (b'{"prompt": ', "request body is not valid JSON"),
])
async def test_invocations_refuses_a_body_it_cannot_route_naming_why(body, message):
    async with served() as (client, engine):
        async with client.post("/invocations", data=body, headers={"Content-Type": "application/json"}) as response:
            answer = await response.json()
    assert response.status == 400 and answer["error"]["code"] == 400 and message in answer["error"]["message"]
    assert engine.submitted == []


def test_route_of_reads_only_the_two_fields():
    assert route_of(b'{"prompt": [1, 2], "messages": [{"role": "user", "content": "x"}]}') == "chat"
    assert route_of(b'{"prompt": [1, 2], "extra": {"messages": 1}}') == "completion"
    assert (route_of(b'{"prompt": null}'), route_of(b'{"messages": null, "prompt": 1}')) == ("completion", "chat")


# ---- /load --------------------------------------------------------------------------------------------------------

async def _load(client) -> int:
    async with client.get("/load") as response:
        assert response.status == 200
        return (await response.json())["server_load"]


async def test_load_counts_the_requests_being_served_under_the_flag():
    engine = FakeEngine(script=list(STORY), step_delay=0.05, script_end=FinishReason.LENGTH)
    async with served(engine, api_key=KEY, api=ApiConfig(enable_server_load_tracking=True)) as (client, _):
        assert await _load(client) == 0  # no key needed: a probe
        streams = [await client.post(path, json={**body, "max_tokens": 8, "stream": True}, headers=WITH_KEY)
                   for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/invocations", {"messages": USER}))]
        for response in streams:
            await response.content.readline()  # the first event is out: being served
        assert await _load(client) == 2
        await post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, headers=WITH_KEY)  # a 400
        await post(client, "/tokenize", {"prompt": PROMPT}, headers=WITH_KEY)  # not a generation route
        assert await _load(client) == 2
        await streams[0].read()
        streams[0].release()
        assert await _load(client) == 1
        await streams[1].read()
        streams[1].release()
        assert await _load(client) == 0


async def test_load_is_zero_without_the_flag_as_vllm_answers():
    engine = FakeEngine(script=list(STORY), step_delay=0.05, script_end=FinishReason.LENGTH)
    async with served(engine) as (client, _):
        async with client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "stream": True}) as busy:
            await busy.content.readline()
            assert await _load(client) == 0


# ---- /tokenizer_info ----------------------------------------------------------------------------------------------

async def test_tokenizer_info_is_served_only_under_the_flag():
    template = (TEMPLATES / "stories_chat.jinja").read_text()
    async with served() as (client, _):
        async with client.get("/tokenizer_info") as response:
            assert response.status == 404
    async with served(api_key=KEY, api=ApiConfig(enable_tokenizer_info_endpoint=True)) as (client, _):
        async with client.get("/tokenizer_info") as response:
            assert response.status == 401  # the tokenizer's details are the API's, behind the key
        async with client.get("/tokenizer_info", headers=WITH_KEY) as response:
            assert response.status == 200
            info = await response.json()
    assert info == {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                    "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
                    "clean_up_tokenization_spaces": False, "model_max_length": 512, "legacy": False,
                    "chat_template": template}


def test_tokenizer_info_writes_added_tokens_as_their_text(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "vocab_file": "/srv/models/x/tokenizer.model", "chat_template": "{{ messages }}",
        "pad_token": {"__type": "AddedToken", "content": "<pad>", "lstrip": False},
        "added_tokens_decoder": {"0": {"content": "<unk>", "special": True, "normalized": False}}}))
    assert tokenizer_info(str(tmp_path), None) == {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>",
                                                   "added_tokens_decoder": {"0": "<unk>"}}
    assert tokenizer_info(str(tmp_path), "T")["chat_template"] == "T"


# ---- --enable-request-id-headers, --disable-fastapi-docs ----------------------------------------------------------

async def test_every_response_carries_x_request_id_under_the_flag():
    async with served(api=ApiConfig(enable_request_id_headers=True, enable_server_load_tracking=True)) as (client, _):
        for method, path, body in (("GET", "/ping", None), ("POST", "/ping", None), ("GET", "/load", None),
                                   ("POST", "/invocations", {"prompt": PROMPT, "max_tokens": 2}),
                                   ("POST", "/invocations", {}), ("GET", "/nowhere", None)):
            async with client.request(method, path, json=body, headers={"X-Request-Id": "trace-9"}) as response:
                assert response.headers["X-Request-Id"] == "trace-9", path
            async with client.request(method, path, json=body) as response:
                assert len(response.headers["X-Request-Id"]) >= 16, path  # made up when the client sent none


async def test_disable_fastapi_docs_serves_no_openapi_document():
    async with served() as (client, _):
        async with client.get("/openapi.json") as response:
            assert response.status == 200 and "/invocations" in (await response.json())["paths"]
    async with served(api=ApiConfig(disable_fastapi_docs=True)) as (client, _):
        for path in ("/openapi.json", "/docs", "/redoc"):
            async with client.get(path) as response:
                assert response.status == 404, path
        async with client.get("/v1/models") as response:
            assert response.status == 200


# ---- --root-path ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, prefix", [("/llm", "/llm"), ("llm/", "/llm"), ("/a/b/", "/a/b"), ("/", ""),
                                           ("", "")])
def test_root_path_is_normalized(given, prefix):
    assert normalize_root_path(given) == prefix


async def test_every_route_answers_under_the_root_path_and_without_it():
    api = ApiConfig(root_path="/llm/", enable_tokenizer_info_endpoint=True)
    async with served(api_key=KEY, api=api) as (client, engine):
        for prefix in ("/llm", ""):
            status, completion = await post(client, f"{prefix}/v1/completions",
                                            {"prompt": PROMPT, "max_tokens": 30}, headers=WITH_KEY)
            assert (status, completion["choices"][0]["text"]) == (200, STORY_TEXT), prefix
            async with client.get(f"{prefix}/v1/models/stories", headers=WITH_KEY) as response:
                assert response.status == 200 and (await response.json())["id"] == "stories"
            for path in ("/health", "/ping", "/metrics", "/load", "/dashboard"):  # open: no key
                async with client.get(prefix + path) as response:
                    assert response.status == 200, prefix + path
            async with client.get(f"{prefix}/v1/models") as response:
                assert response.status == 401  # the key is checked under the prefix as without it
            async with client.get(f"{prefix}/v1/completions", headers=WITH_KEY) as response:
                assert response.status == 405 and response.headers["Allow"] == "POST"
            async with client.get(f"{prefix}/tokenizer_info", headers=WITH_KEY) as response:
                assert response.status == 200
        for path in ("/llmx/v1/models", "/llm/v1/nothing", "/llm", "/llm/llm/v1/models"):  # the prefix once only
            async with client.get(path, headers=WITH_KEY) as response:
                assert response.status == 404, path
        async with client.get("/llm/openapi.json", headers=WITH_KEY) as response:
            document = await response.json()
        assert document["servers"] == [{"url": "/llm"}] and "/tokenizer_info" in document["paths"]
        async with client.get("/llm/dashboard") as response:
            page = await response.text()
        assert 'fetch("./v1/stats/stream?window="' in page  # relative: /llm/dashboard reads /llm/v1/stats/stream
        async with client.get("/llm/v1/stats/stream?window=2", headers=WITH_KEY) as response:
            assert response.status == 200 and (await response.content.readline()).startswith(b"data: {")
        async with client.post("/llm/v1/messages", json={"max_tokens": 2}, headers=WITH_KEY) as response:
            assert response.status == 400 and (await response.json())["type"] == "error"  # Anthropic's shape there
    assert len(engine.submitted) == 2


# ---- --uds ---------------------------------------------------------------------------------------------------------

async def test_uds_serves_http_on_a_unix_socket(tmp_path):
    path = str(tmp_path / "shuttle.sock")
    runner = web.AppRunner(frontend_app(FakeEngine(script=list(STORY))), handler_cancellation=True, access_log=None)
    await runner.setup()
    server = await listen(runner, "127.0.0.1", 0, OpsConfig(), uds=path)
    try:
        assert listen_url("127.0.0.1", server, path) == f"unix:{path}"
        assert server.sockets[0].family == socket.AF_UNIX
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
            async with session.get("http://localhost/health") as response:
                assert response.status == 200 and (await response.json())["status"] == "ok"
            async with session.post("http://localhost/v1/completions",
                                    json={"prompt": PROMPT, "max_tokens": 30}) as response:
                assert (await response.json())["choices"][0]["text"] == STORY_TEXT
        with pytest.raises(OSError, match="already listens"):  # a live server's socket is not taken from it
            await listen(runner, "127.0.0.1", 0, OpsConfig(), uds=path)
    finally:
        server.close()
        await server.wait_closed()
        await runner.cleanup()
    remove_socket_file(path)
    assert not Path(path).exists()


async def test_a_socket_file_left_behind_is_replaced(tmp_path):
    path = str(tmp_path / "stale.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # bound, never listening: what a killed server leaves
    stale.close()
    runner = web.AppRunner(frontend_app(FakeEngine()), access_log=None)
    await runner.setup()
    server = await listen(runner, "127.0.0.1", 0, OpsConfig(), uds=path)
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        server.close()
        await runner.cleanup()
        remove_socket_file(path)


def test_tcp_url_names_the_port_the_server_got():
    class Server:
        sockets = [type("S", (), {"getsockname": lambda self: ("127.0.0.1", 8123)})()]

    assert listen_url("127.0.0.1", Server()) == "http://127.0.0.1:8123"  # type: ignore[arg-type]


# ---- --uvicorn-log-level ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("level, logged", [("trace", True), ("debug", True), ("info", True), ("warning", False),
                                           ("error", False), ("critical", False)])
async def test_uvicorn_log_level_sets_the_access_log(level, logged, caplog):
    logger = access_logger(level)
    assert logging.getLogger("aiohttp.access").level == (logging.DEBUG if level == "trace" else
                                                         getattr(logging, level.upper()))
    runner = web.AppRunner(frontend_app(FakeEngine()), access_log=None)
    await runner.setup()
    server = await listen(runner, "127.0.0.1", 0, OpsConfig(), access_log=logger)
    try:
        with caplog.at_level(logging.NOTSET):
            async with aiohttp.ClientSession() as session, session.get(f"{listen_url('127.0.0.1', server)}/ping"):
                pass
            await asyncio.sleep(0.05)  # the line is written once the response is done
    finally:
        server.close()
        await runner.cleanup()
        logging.getLogger("aiohttp.access").setLevel(logging.NOTSET)
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert (lines[0].split(" - ", 1)[1].startswith('"GET /ping HTTP/1.1" 200') if logged else lines == []), lines
    assert len(lines) == (1 if logged else 0)


def test_the_launcher_checks_no_http_port_on_uds():
    """On --uds no TCP port is listened on for HTTP, so none is checked (the batch endpoint's still is)."""
    config = replace(make_config(), port=8000, batch_endpoint="tcp://127.0.0.1:8001")
    args = argparse.Namespace(batch_endpoint=None)
    assert [listen.port for listen in _frontend_listens(args, config)] == [8000, 8001]
    assert [listen.port for listen in _frontend_listens(args, replace(config, api=ApiConfig(uds="/tmp/s")))] == [8001]


def test_the_launcher_refuses_a_uds_path_no_server_could_listen_on(tmp_path):
    """A fresh-clone trial: a --uds path in a missing directory, or one a server already listens on, failed only
    after the model was loaded and compiled (exit 1); the launcher names it first, as a taken port."""
    from shuttle.launcher.ports import PortError

    config = replace(make_config(), port=8000, batch_endpoint="")
    args = argparse.Namespace(batch_endpoint="none")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / "live.sock"))
    live.listen(1)
    (tmp_path / "plain").write_text("")
    try:
        for path, words in [(tmp_path / "no" / "s.sock", "does not exist"),
                            (tmp_path / "live.sock", "a server already listens on it"),
                            (tmp_path / "plain", "a file that is not a socket is there")]:
            with pytest.raises(PortError, match=f"--uds {path}: .*{words}"):
                _frontend_listens(args, replace(config, api=ApiConfig(uds=str(path))))
    finally:
        live.close()
    assert _frontend_listens(args, replace(config, api=ApiConfig(uds=str(tmp_path / "free.sock")))) == []


def test_uds_puts_the_batch_endpoint_beside_the_http_socket(tmp_path, monkeypatch):
    """Two --uds servers on one host collided on TCP PORT+1: the batch endpoint is ipc://PATH.batch unless given."""
    from shuttle.common.config import IpcConfig, ShuttleConfig
    from shuttle.launcher import cli
    from shuttle.launcher.model_args import resolve_model_args
    from tests.server import MODEL_DIR

    def configured(*flags: str) -> tuple[ShuttleConfig, argparse.Namespace]:
        args = cli.build_parser().parse_args(["serve", str(MODEL_DIR), *flags])
        resolve_model_args(args)
        return ShuttleConfig.from_args(args, IpcConfig.in_directory(str(tmp_path))), args

    monkeypatch.chdir(tmp_path)  # a relative PATH is made absolute, so a batch client can use the printed endpoint
    config, args = configured("--uds", "shuttle.sock")
    assert config.batch_endpoint == f"ipc://{tmp_path}/shuttle.sock.batch"
    assert _frontend_listens(args, config) == []  # no TCP port at all
    assert configured("--uds", "s.sock", "--batch-endpoint", "tcp://127.0.0.1:9001")[0].batch_endpoint == \
        "tcp://127.0.0.1:9001"
    assert configured("--uds", "s.sock", "--batch-endpoint", "none")[0].batch_endpoint == ""
    assert configured("--port", "8100")[0].batch_endpoint == "tcp://127.0.0.1:8101"
