"""Turning a request body into a Call off the event loop when the body is large.

Decoding, validating, rendering the chat template and tokenizing take time proportional to the body: for a 4 MiB
body of 40,000 input items, seconds. On the event loop that would pause every other stream of this frontend (and
past --heartbeat-timeout, the launcher would take the frontend for hung), so a body of OFF_LOOP_BYTES or more is
converted in a small thread pool; the loop keeps serving (CPython hands it the GIL every switch interval, 5 ms).
A small body is converted in place: the thread hop would cost more than the work.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

OFF_LOOP_BYTES = 32 * 1024  # a body under this converts in well under a millisecond per KiB: in place
CONVERT_THREADS = 2  # large bodies wait their turn here, never on the loop

_pool: ThreadPoolExecutor | None = None


async def convert(make: Callable[[], T], size: int | None) -> T:
    """`make()` in place when `size` (the body's bytes) is under OFF_LOOP_BYTES, else in the conversion pool
    (`size` None: not known, so the pool). Exceptions of `make` are raised here as they are."""
    global _pool
    if size is not None and size < OFF_LOOP_BYTES:
        return make()
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=CONVERT_THREADS, thread_name_prefix="convert-request")
    return await asyncio.get_running_loop().run_in_executor(_pool, make)
