"""CORS for browser clients (`--allowed-origins`): preflight answers and the headers of actual responses.

With no allowed origins nothing here runs, so a response never carries CORS headers and a browser page on another
origin cannot read it. The Fetch standard's rules: a preflight (OPTIONS with Origin and
Access-Control-Request-Method) is answered before authentication, since browsers never send credentials with it.
"""

from __future__ import annotations

import re

from aiohttp import web

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"  # DELETE: /v1/responses/{id}
EXPOSED_HEADERS = "x-request-id"
MAX_AGE_S = 600
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


class Cors:
    """Args: allowed_origins: exact origins (scheme://host[:port]); "*" allows any."""

    def __init__(self, allowed_origins: tuple[str, ...]):
        self.any_origin = "*" in allowed_origins
        self.origins = frozenset(allowed_origins)

    def allow_origin(self, request: web.Request) -> str | None:
        """The Access-Control-Allow-Origin value for this request, or None when it gets no CORS headers."""
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        if self.any_origin:
            return "*"
        return origin if origin in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler) -> web.StreamResponse:
        """Answer a preflight from an allowed origin with 204; anything else goes on to the routes."""
        allow = self.allow_origin(request)
        if request.method != "OPTIONS" or allow is None or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        requested = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")]
        # Any request header is allowed (the official clients add their own x-stainless-* ones)
        allowed = ", ".join(h for h in requested if _HEADER_NAME.match(h)) or "Authorization, Content-Type"
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": ALLOWED_METHODS, "Access-Control-Allow-Headers": allowed,
            "Access-Control-Max-Age": str(MAX_AGE_S),
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"})

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """CORS headers on every response to an allowed origin (streams and errors included)."""
        allow = self.allow_origin(request)
        if allow is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allow
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        if allow != "*" and "Origin" not in response.headers.get("Vary", ""):
            vary = response.headers.get("Vary")
            response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
