"""The aiohttp application: routes, health, and the server's start-up."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from aiohttp import web

from common.config import ShuttleConfig
from frontend.chat import ChatTemplate
from frontend.engine_client import EngineClient
from frontend.metrics import Metrics
from frontend.cors import Cors
from frontend.middleware import api_key_auth, json_content_type, openai_errors, request_id_header
from frontend.openai_api import create_chat_completion, create_completion, list_models, retrieve_model
from frontend.state import STATE, FrontendState
from frontend.tokenize_api import detokenize, tokenize
from frontend.tokenizer import TextTokenizer
from frontend.websocket import websocket_handler
from frontend.zmq_api import BatchEndpoint

log = logging.getLogger("shuttle.frontend")


async def health(request: web.Request) -> web.Response:
    """Liveness plus the scheduler's latest stats; answers from memory, never waits on the model."""
    state = request.app[STATE]
    stats = state.engine.stats
    return web.json_response({
        "status": "ok",
        "in_flight": state.engine.num_in_flight,
        "scheduler": {name: getattr(stats, name) for name in stats.__struct_fields__},
    })


MAX_BODY_BYTES = 4 * 2**20
SHUTDOWN_GRACE_S = 0.5


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format."""
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def build_app(state: FrontendState, api_key: str | None = None) -> web.Application:
    cors = Cors(state.config.allowed_origins) if state.config.allowed_origins else None
    middlewares = ([cors.preflight] if cors else []) + [openai_errors] + (
        [api_key_auth(api_key)] if api_key else []) + [json_content_type]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.on_response_prepare.append(request_id_header)
    if cors:
        app.on_response_prepare.append(cors.on_response_prepare)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", retrieve_model)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/ws", websocket_handler)
    return app


async def serve(config: ShuttleConfig, on_ready) -> None:
    """Connect to the scheduler, listen on config.host:config.port (and the batch endpoint), call
    `on_ready(url, batch_endpoint)`, run forever."""
    tokenizer = TextTokenizer(config.model.model_dir)
    engine = EngineClient(config.ipc.requests)
    registry = Metrics(lambda: engine.stats)
    engine.on_stats = registry.observe_steps
    await engine.start()
    chat_template = ChatTemplate(config.model.model_dir, config.chat_template)
    state = FrontendState(config, engine, tokenizer, chat_template, registry)
    app = build_app(state, os.environ.get("SHUTTLE_API_KEY"))
    batch = BatchEndpoint(state, config.batch_endpoint) if config.batch_endpoint else None
    batch_task = asyncio.create_task(batch.serve()) if batch else None
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{config.host}:{port}"
    log.info("serving %s on %s", config.model.served_model_name, url)
    on_ready(url, batch.endpoint if batch else "")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
        # Shutting down (Ctrl-C, or another process died): every in-flight request gets its terminal error now,
        # and its handler a moment to write it, before the server goes.
        if engine.num_in_flight:
            engine.fail_all(503, "the server is shutting down")
            await asyncio.sleep(SHUTDOWN_GRACE_S)
    finally:
        if batch_task is not None:
            batch_task.cancel()
            batch.close()
        await runner.cleanup()
        engine.close()
