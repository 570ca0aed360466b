"""GET /dashboard (the live page) and GET /v1/stats/stream (its feed, Server-Sent Events).

The page is one self-contained HTML document: its script and style, kept as package data in
frontend/observability/static/,
are inlined when it is first served, so it needs no CDN and no other request than the feed. The page holds
no data, so it is served without the API key; the feed is a /v1 endpoint and needs the key like the others
(the page sends it as `Authorization: Bearer`, from its key field or from the address fragment `#key=...`,
which browsers never send to a server, so the key appears in no request line and no log).

The feed sends one `data: {json}` event every frontend/observability/stats_feed.py TICK_S seconds. Its keys:
  time                server clock (monotonic seconds), window_s: how much history the windowed figures cover
  status              "ok", "degraded" (a serving group down, another serving), "draining" or "engine_down"
  waiting, running    the scheduler's queue and running set; in_flight: requests this frontend is serving
  kv                  blocks {in_use (referenced), cached (in the prefix index, in use or not), free, total}
  prefix_cache        {hit_rate (in the window, of prompt tokens looked up), hit_rate_total, queries, hits}
  preemptions         {total, window}
  throughput          per second over the last RATE_WINDOW_S: generation_tokens_s, prompt_tokens_s,
                      scheduled_tokens_s, requests_s (finished), steps_s
  ttft_ms, itl_ms     {count, p50, p90, p99} in the window, from the frontend's histograms (interpolated in buckets)
  steps               [[seq, age_s (<= 0, relative to time), prefill_tokens, decode_tokens], ...] new since the
                      previous frame; num_steps: the scheduler's step count
  config              (first frame only) the flags that shape scheduling: budgets, policy, cache geometry
"""

from __future__ import annotations

import base64
import hashlib
from importlib import resources

from aiohttp import web

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.observability.stats_feed import MAX_WINDOW_S, StatsFeed
from shuttle.frontend.state import FrontendState

FEED = web.AppKey("shuttle_stats_feed", StatsFeed)
DEFAULT_WINDOW_S = 30.0


def _static(name: str) -> str:
    return resources.files("shuttle.frontend.observability").joinpath("static", name).read_text(encoding="utf-8")


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def render_page() -> tuple[str, str]:
    """(the page's HTML with its script and style inlined, its Content-Security-Policy): only that script and
    that style may run, and the page may connect to its own origin only."""
    script, style = _static("dashboard.js"), _static("dashboard.css")
    html = _static("dashboard.html").replace("/*STYLE*/", style).replace("/*SCRIPT*/", script)
    csp = (f"default-src 'none'; script-src {_csp_hash(script)}; style-src {_csp_hash(style)}; "
           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, csp


async def dashboard_page(request: web.Request) -> web.Response:
    """The dashboard page (no data in it; the feed it opens needs the API key when one is set)."""
    html, csp = request.app[PAGE]
    return web.Response(text=html, content_type="text/html", charset="utf-8",
                        headers={"Content-Security-Policy": csp, "Cache-Control": "no-store",
                                 "Referrer-Policy": "no-referrer"})


def _window(request: web.Request) -> float:
    """The `window` query parameter: seconds of history for the windowed figures (default 30, at most 300).

    Raises:
        InvalidRequestError: not a number in (0, 300].
    """
    raw = request.query.get("window")
    if raw is None:
        return DEFAULT_WINDOW_S
    try:
        window = float(raw)
    except ValueError:
        window = float("nan")
    if not 0 < window <= MAX_WINDOW_S:
        raise InvalidRequestError(f"window must be a number of seconds in (0, {MAX_WINDOW_S:g}]", "window")
    return window


async def stats_stream(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events of live stats, until the client leaves or the server stops."""
    window = _window(request)
    feed = request.app[FEED]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    async with feed.subscribe(window) as subscription:
        while (frame := await subscription.next()) is not None:
            await response.write(b"data: " + frame + b"\n\n")
    return response


PAGE = web.AppKey("shuttle_dashboard_page", tuple)


def add_dashboard(app: web.Application, state: FrontendState) -> StatsFeed:
    """Register /dashboard and /v1/stats/stream on `app`, and hook the feed onto the engine's stats."""
    feed = StatsFeed(state.engine, state.metrics, state.config)
    state.engine.on_stats = feed.chain(state.engine.on_stats)
    app[FEED] = feed
    app[PAGE] = render_page()

    async def close_feed(_app: web.Application) -> None:
        feed.close()

    app.on_shutdown.append(close_feed)
    app.router.add_get("/dashboard", dashboard_page)
    app.router.add_get("/v1/stats/stream", stats_stream)
    return feed
