"""GET /load: `{"server_load": N}`, the requests being served, as vLLM counts them under
--enable-server-load-tracking (without the flag nothing is counted and /load answers 0, as vLLM's does).

A request counts from the moment its handler starts until its answer has been written, a stream's last event
included, whether it succeeds or fails. Counted are the routes vLLM counts that shuttle serves: completions, chat
completions, the Responses API (every /v1/responses route), Anthropic's /v1/messages and SageMaker's /invocations.
"""

from __future__ import annotations

from aiohttp import web

LOAD = web.AppKey("shuttle_server_load", list)  # [requests being served]: a one-item list, mutated in place
COUNTED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/invocations"})


def counted(route_path: str) -> bool:
    """Whether a request to the route at `route_path` (its own path, without --root-path) counts as load."""
    return route_path in COUNTED or route_path == "/v1/responses" or route_path.startswith("/v1/responses/")


@web.middleware
async def count_load(request: web.Request, handler) -> web.StreamResponse:
    """Middleware counting the requests being served in `request.app[LOAD]` (placed after the API-key check: a
    refused request is not served)."""
    resource = request.match_info.route.resource
    if resource is None or not counted(resource.canonical):
        return await handler(request)
    load = request.app[LOAD]
    load[0] += 1
    try:
        return await handler(request)
    finally:
        load[0] -= 1


async def server_load(request: web.Request) -> web.Response:
    """GET /load: {"server_load": requests being served} (0 when the server does not track its load)."""
    load = request.app.get(LOAD)
    return web.json_response({"server_load": load[0] if load else 0})
