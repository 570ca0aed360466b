"""--root-path PREFIX: every route answers under PREFIX as well as without it, as Starlette does for uvicorn's
root_path (a reverse proxy may forward /llm/v1/models as it is, or strip the prefix first).

aiohttp resolves a route before any middleware runs, so the prefix cannot be stripped by a middleware: RootPath is
a resource of the router (aiohttp's public AbstractResource) indexed under the prefix, which resolves a request
under it by resolving the rest of its path against the same router. The handler then gets the request as sent (its
`path` keeps the prefix) and the match of the route it names (`match_info.route.resource.canonical` is the route's
own path, without the prefix: what the API-key check reads). The prefix is stripped once: the inner resolution
skips this resource, so /llm/llm/v1/models is a 404 under --root-path /llm, as Starlette's mount answers.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Iterator

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractResource, AbstractRoute, UrlMappingMatchInfo
from yarl import URL

# set while a RootPath resolves the rest of a path, so the router's pass over it does not strip the prefix again
_INNER: ContextVar[bool] = ContextVar("root_path_inner", default=False)


def normalize_root_path(root_path: str) -> str:
    """`root_path` as a path prefix: one leading slash, no trailing one ("" and "/" mean none)."""
    stripped = root_path.strip().strip("/")
    return f"/{stripped}" if stripped else ""


class RootPath(AbstractResource):
    """The routes of `router` again under `prefix` (normalized by normalize_root_path, not empty)."""

    def __init__(self, prefix: str, router: web.UrlDispatcher):
        super().__init__()
        self._prefix = prefix
        self._router = router

    @property
    def canonical(self) -> str:
        return self._prefix

    def url_for(self, **kwargs: str) -> URL:
        return URL.build(path=self._prefix)

    async def resolve(self, request: web.Request) -> tuple[UrlMappingMatchInfo | None, set[str]]:
        path = request.rel_url.path
        if _INNER.get() or (path != self._prefix and not path.startswith(self._prefix + "/")):
            return None, set()
        inner = request.clone(rel_url=request.rel_url.with_path(path[len(self._prefix):] or "/"))
        token = _INNER.set(True)
        try:
            match = await self._router.resolve(inner)
        finally:
            _INNER.reset(token)
        exception = match.http_exception
        if exception is None:
            return match, set()
        # a route under the prefix that does not take this method: 405 naming the methods it takes
        return None, set(getattr(exception, "allowed_methods", ()))

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError("the root path resource cannot be mounted under another prefix")

    def get_info(self) -> dict:  # type: ignore[override]  # aiohttp's _InfoDict is private
        return {"prefix": self._prefix}

    def raw_match(self, path: str) -> bool:
        return path == self._prefix

    def __len__(self) -> int:
        return 0  # its routes are the router's own: listing them twice would count each route twice

    def __iter__(self) -> Iterator[AbstractRoute]:
        return iter(())


def route_path(request: web.Request) -> str:
    """The path of the route `request` matched, as registered (without --root-path's prefix; a dynamic route's
    with its {names}); the path as requested when it matched none."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def add_root_path(app: web.Application, root_path: str) -> None:
    """Serve every route of `app` under `root_path` too (nothing for an empty one). Routes added afterwards are
    served under it as well: the prefix is resolved against the whole router at request time."""
    prefix = normalize_root_path(root_path)
    if prefix:
        app.router.register_resource(RootPath(prefix, app.router))
