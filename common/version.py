"""shuttle's version, from the installed package's metadata (pyproject.toml), for `shuttle --version` and
GET /version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def shuttle_version() -> str:
    """The installed shuttle's version ("unknown" when run from a tree that was never installed)."""
    try:
        return version("shuttle")
    except PackageNotFoundError:
        return "unknown"
