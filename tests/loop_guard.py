"""A check after every test that it left the suite's shared event loop as it found it.

All async tests share one session-wide event loop (pyproject's asyncio_default_*_loop_scope). A test that leaves an
async HTTP client (httpx's AsyncClient; every openai.AsyncOpenAI holds one) open hands its sockets to the garbage
collector, which may close them in the middle of a later test: the freed fd number is reused by that test's new socket
(a TestServer's listening socket) and the stale selector registration, or the old transport's late close, takes the new
socket's registration away. That test's request is then never polled and hangs until pytest-timeout. So every test:

- must close each such client it opened, unless something long-lived still holds it (langchain's module-level
  client cache): at teardown the guard drops its own references and collects, and a client that was garbage while
  still open fails the test that opened it, by name;
- must leave no registration in the loop's selector whose fd the loop's epoll set no longer holds (an fd closed while
  registered): such a registration fails the test, and is removed so that it cannot take the next test down.

The collection after each test walks only what was created since its module began: what collection left alive, and
what outlived each finished module, is frozen (gc.freeze), as common/process.py does for a served process.
"""
from __future__ import annotations

import asyncio
import gc
import importlib
import os
import weakref

import pytest
import pytest_asyncio

_opened: list = []  # every async HTTP client opened since the last test's check, held until that check


def _track(client_class) -> None:
    original_init = client_class.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _opened.append(self)
    client_class.__init__ = tracking_init


# httpx (langchain, aiohttp-free code) and httpx2 (the openai client since its 3.x releases) alike
for _name in ("httpx", "httpx2"):
    try:
        _track(importlib.import_module(_name).AsyncClient)
    except ImportError:
        pass


def epoll_fds(epoll_fd: int) -> set[int]:
    """The fds in an epoll set, read from /proc/self/fdinfo/<epoll fd> (one `tfd:` line per watched fd)."""
    with open(f"/proc/self/fdinfo/{epoll_fd}") as info:
        return {int(line.split()[1]) for line in info if line.startswith("tfd:")}


def stale_registrations(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Fds the loop's selector still maps whose fd the epoll set no longer holds (closed while registered), sorted.
    Empty for a loop without an epoll selector (uvloop, another platform's selector): nothing to compare."""
    selector = getattr(loop, "_selector", None)
    epoll = getattr(selector, "_selector", None)
    if epoll is None or not hasattr(epoll, "fileno") or not os.path.exists(f"/proc/self/fdinfo/{epoll.fileno()}"):
        return []
    watched = epoll_fds(epoll.fileno())
    return sorted(fd for fd in selector.get_map() if fd not in watched)


def _freeze_survivors() -> None:
    """Collect, then take every survivor out of later collections (as common/process.py does for a served process).
    The guard collects after every test; walking the imported modules and the parametrize tables each time cost most
    of a second a test. What a test creates stays collectable until its module is done."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_survivors()


def pytest_unconfigure(config):
    """Back in the collector's reach for the interpreter's exit: extension modules that count their live objects at
    exit (triton's nanobind bindings) report frozen ones as leaked."""
    gc.unfreeze()
    gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a module's last test (its module-scoped fixtures torn down), freeze what outlives it: the modules it
    imported and the caches it filled."""
    yield
    if nextitem is None or nextitem.path != item.path:
        _freeze_survivors()


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def loop_guard():
    yield
    loop = asyncio.get_running_loop()
    left_open = [weakref.ref(client) for client in _opened if not client.is_closed]
    _opened.clear()
    gc.collect()
    garbage = sum(ref() is None for ref in left_open)
    await asyncio.sleep(0)  # let the collected transports' close callbacks run before reading the selector
    stale = stale_registrations(loop)
    for fd in stale:
        loop._selector.unregister(fd)
    problems = []
    if garbage:
        problems.append(f"{garbage} async HTTP client(s) (an openai.AsyncOpenAI's) left open and unreferenced: close "
                        "each in the test that opens it (async with, or await client.close())")
    if stale:
        problems.append(f"the event loop kept registrations for closed fds {stale}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
