"""Run by tests/unit/test_loop_guard.py in a pytester subprocess (not collected here: no test_ prefix): the first test
leaves an openai client open on a server that outlives it; the second collects the garbage and starts a new server,
whose listening socket gets the freed fd number and, without the guard, is never polled."""

import asyncio
import gc

import openai
from aiohttp import web
from aiohttp.test_utils import TestServer


def app():
    async def models(request):
        return web.json_response({"object": "list", "data": []})
    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app

HANG_S = 5  # a request on loopback answers in milliseconds, even on a crowded machine
KEPT = []

async def test_leaves_a_client_open():
    server = TestServer(app())
    await server.start_server()
    KEPT.append(server)  # a server that outlives the test, as a session fixture's does
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
    await client.models.list()
    client.cycle = client  # freed only by a collection, at a time nobody chooses

async def test_next_server_is_polled():
    gc.collect()
    async with TestServer(app()) as server:
        async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as client:
            await asyncio.wait_for(client.models.list(), HANG_S)
