"""The aiohttp application: routes, health, and the server's life: start-up, supervision, drain."""

from __future__ import annotations

import asyncio
import logging
import os

from aiohttp import web

from shuttle.common.config import ShuttleConfig
from shuttle.common.process import DRAIN_SIGNAL, PARENT_GONE_SIGNAL
from shuttle.common.sampling import logprobs_limit
from shuttle.common.version import shuttle_version
from shuttle.frontend import last_words
from shuttle.frontend.anthropic.errors import anthropic_errors
from shuttle.frontend.anthropic.routes import add_routes as add_messages_routes
from shuttle.frontend.completions.routes import (
    create_chat_completion,
    create_completion,
    list_models,
    retrieve_model,
)
from shuttle.frontend.completions.tokenize import detokenize, tokenize
from shuttle.frontend.engine.backpressure import refusal_headers
from shuttle.frontend.engine.client import EngineClient
from shuttle.frontend.engine.router import Router
from shuttle.frontend.lifecycle import Shutdown, SupervisorLink, drain
from shuttle.frontend.lora_routes import add_lora_routes
from shuttle.frontend.observability.dashboard import add_dashboard
from shuttle.frontend.observability.metrics import Metrics
from shuttle.frontend.observability.tracing import RequestTracer, trace_context_middleware
from shuttle.frontend.request.chat_template import ChatTemplate
from shuttle.frontend.responses.routes import add_routes as add_responses_routes
from shuttle.frontend.state import STATE, FrontendState
from shuttle.frontend.tokenizer import TextTokenizer
from shuttle.frontend.transports.websocket import websocket_handler
from shuttle.frontend.transports.zmq_batch import BatchEndpoint
from shuttle.frontend.web.cors import Cors
from shuttle.frontend.web.middleware import (
    api_key_auth,
    json_content_type,
    openai_errors,
    reads_no_body,
    request_id_header,
)
from shuttle.frontend.web.openapi import openapi_document
from shuttle.frontend.web.root_path import add_root_path, normalize_root_path
from shuttle.frontend.web.sagemaker import invocations
from shuttle.frontend.web.server import access_logger, listen, listen_url, remove_socket_file, request_limits
from shuttle.frontend.web.server_load import LOAD, count_load, server_load
from shuttle.frontend.web.tokenizer_info import add_tokenizer_info

log = logging.getLogger("shuttle.frontend")

BATCH = web.AppKey("shuttle_batch_endpoint", BatchEndpoint)


@reads_no_body  # POST /ping too
async def health(request: web.Request) -> web.Response:
    """Liveness plus the schedulers' latest stats; answers from memory, never waits on the model.

    200 {"status": "ok"} while serving ("degraded" while some serving group is down and another serves);
    503 {"status": "draining"} during a SIGTERM drain and 503 {"status": "engine_down", "reason": ...} while no
    group serves. "scheduler" sums the groups' stats; "groups" lists each group's state and stats.
    """
    state = request.app[STATE]
    engine = state.engine
    stats = engine.stats
    groups = engine.group_states()
    body = {"status": "ok" if all(g.up for g in groups) else "degraded", "in_flight": engine.num_in_flight,
            "scheduler": _stats_dict(stats),
            "groups": [{"group": g.group, "endpoint": g.endpoint, "status": "ok" if g.up else "engine_down",
                        **({"reason": g.reason} if g.reason else {}), "in_flight": g.in_flight,
                        "times_down": g.times_down, "routed": g.routed, "scheduler": _stats_dict(g.stats)}
                       for g in groups]}
    if BATCH in request.app:
        body["batch"] = request.app[BATCH].stats()
    refusal = engine.admission_error()
    if refusal is None:
        return web.json_response(body)
    body["status"] = "draining" if engine.draining else "engine_down"
    if engine.down_reason:
        body["reason"] = engine.down_reason
    response = web.json_response(body, status=503, headers=refusal_headers(refusal.retry_after, engine.draining))
    if engine.draining:
        response.force_close()  # going away: no promise (frontend/engine/backpressure.py)
    return response


def _stats_dict(stats) -> dict:
    return {name: getattr(stats, name) for name in stats.__struct_fields__}


MAX_BODY_BYTES = 4 * 2**20


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format."""
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI 3.1 document of the HTTP API, its request bodies generated from the request Structs (and bounded
    by the served model's name and vocabulary)."""
    state = request.app[STATE]
    api = state.config.api
    return web.json_response(openapi_document(state.model_name, state.tokenizer.vocab_size,
                                              api.enable_tokenizer_info_endpoint, normalize_root_path(api.root_path),
                                              state.config.lora.enable_lora,
                                              logprobs_limit(state.config.model.max_logprobs,
                                                             state.tokenizer.vocab_size)))


async def version(request: web.Request) -> web.Response:
    """GET /version: shuttle's version (vLLM answers the same path with its own)."""
    return web.json_response({"version": shuttle_version()})


def build_app(state: FrontendState, api_key: str | None = None) -> web.Application:
    cors = Cors(state.config.allowed_origins) if state.config.allowed_origins else None
    middlewares = ([cors.preflight] if cors else []) + [anthropic_errors, openai_errors] + (
        [api_key_auth(api_key)] if api_key else []) + [json_content_type]
    middlewares.append(request_limits(MAX_BODY_BYTES, state.config.ops.body_timeout))
    if state.metrics.tracer is not None:
        middlewares.append(trace_context_middleware())
    api = state.config.api
    if api.enable_server_load_tracking:
        middlewares.append(count_load)
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    if api.enable_server_load_tracking:
        app[LOAD] = [0]
    app.on_response_prepare.append(request_id_header)
    if cors:
        app.on_response_prepare.append(cors.on_response_prepare)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)  # SageMaker's health route, as vLLM's
    app.router.add_post("/ping", health)
    app.router.add_post("/invocations", invocations)  # SageMaker's inference route (frontend/web/sagemaker.py)
    app.router.add_get("/load", server_load)
    app.router.add_get("/metrics", metrics)
    if not api.disable_fastapi_docs:
        app.router.add_get("/openapi.json", openapi)
    if api.enable_tokenizer_info_endpoint:
        add_tokenizer_info(app)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", retrieve_model)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    add_responses_routes(app)  # OpenAI's Responses API, with its store
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/ws", websocket_handler)
    add_messages_routes(app)  # Anthropic's Messages API
    add_lora_routes(app, state)  # runtime LoRA loads, when VLLM_ALLOW_RUNTIME_LORA_UPDATING allows them
    add_dashboard(app, state)
    add_root_path(app, api.root_path)  # last, though routes added later are served under it too
    return app


async def serve(config: ShuttleConfig, on_ready) -> None:
    """Connect to the scheduler, listen on config.host:config.port or the Unix socket config.api.uds (and the batch
    endpoint), call `on_ready(url, batch_endpoint)` (url "unix:PATH" on a socket), serve until the launcher says
    drain (DRAIN_SIGNAL), then drain."""
    tokenizer = TextTokenizer(config.model.tokenizer_dir or config.model.model_dir)
    local = len(config.ipc.all_groups) - len(config.ipc.remote_groups)  # the launcher's; remote ones join later
    engine = Router([EngineClient(endpoint, config.ipc.curve, remote=endpoint in config.ipc.remote_groups,
                                  silence_timeout=config.ops.heartbeat_timeout,
                                  max_model_len=config.model.max_model_len, lora=config.lora.enable_lora)
                     for endpoint in config.ipc.all_groups], config.scheduler.max_num_seqs, wait_for=local)
    registry = Metrics(lambda: engine.stats, engine.group_states, config, lambda: engine.info)
    if config.observability.otlp_traces_endpoint:  # the launcher checked that the SDK is installed
        registry.tracer = RequestTracer(config.observability.otlp_traces_endpoint, config.model.served_model_name)
    engine.on_stats = registry.observe_steps
    link = SupervisorLink(config, engine)
    link.start()
    await engine.start()
    chat_template = ChatTemplate(config.model.tokenizer_dir or config.model.model_dir, config.chat_template)
    state = FrontendState(config, engine, tokenizer, chat_template, registry)
    api_key = os.environ.get("SHUTTLE_API_KEY")
    app = build_app(state, api_key)
    batch = BatchEndpoint(state, config.batch_endpoint, api_key, config.scheduler.batch_background) \
        if config.batch_endpoint else None
    if batch is not None:
        app[BATCH] = batch
    batch_task = asyncio.create_task(batch.serve()) if batch else None
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    shutdown = Shutdown()
    asyncio.get_running_loop().add_signal_handler(DRAIN_SIGNAL, shutdown.on_signal)  # the launcher's; SIGTERM: ignored
    asyncio.get_running_loop().add_signal_handler(PARENT_GONE_SIGNAL, shutdown.on_parent_gone)  # the launcher died
    last_words.install()  # the launcher's SIGUSR2 when it replaces this process: open streams end with an error
    uds = config.api.uds
    server = await listen(runner, config.host, config.port, config.ops, uds=uds,
                          access_log=access_logger(config.api.uvicorn_log_level))
    url = listen_url(config.host, server, uds)
    log.info("serving %s on %s", config.model.served_model_name, url)
    on_ready(url, batch.endpoint if batch else "")
    try:
        await shutdown.requested.wait()
        # The listening socket stays open while draining, so newcomers get a 503 at once instead of a refusal.
        await drain(engine, config.ops.shutdown_timeout, shutdown.hurry, state.websockets)
    finally:
        server.close()
        if uds:
            remove_socket_file(uds)
        if batch is not None and batch_task is not None:
            batch_task.cancel()
            batch.close()
            if batch.endpoint.startswith("ipc://"):  # libzmq leaves the file behind when the process exits first
                remove_socket_file(batch.endpoint[len("ipc://"):])
        await runner.cleanup()
        link.close()
        engine.close()
        if registry.tracer is not None:
            registry.tracer.flush()  # the spans still buffered go out
