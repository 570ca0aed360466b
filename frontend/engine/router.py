"""Data parallelism in the frontend: one engine client per serving group, and the choice of group per request.

A serving group is a scheduler and its worker(s), with its own KV cache and sockets. The router implements the
frontend's one engine interface (frontend/engine/api.py's Engine) over several groups and sends each new sequence to
one of them:
1. Prefix affinity: a prompt whose leading full blocks were sent to a group before goes there again, since that
   group's prefix cache probably still holds their KV. Blocks are named by common/block_hash.py's stable chained
   digests (the scheduler's own names), kept in a bounded LRU map digest -> group.
2. Least load otherwise, or when the preferred group is much busier (its load exceeds the least by more than
   half a full batch, `max_num_seqs / 2`: past that the queueing costs more than recomputing the prefix). Load
   is waiting + running from the group's latest stats, or this frontend's own sequences in flight there when that
   is larger (stats lag behind a burst; the own count moves with every submit). KV usage breaks ties, then
   rotation.
Only groups that are up take new work; a group that goes down fails only its own in-flight requests (its
EngineClient does that) and the others keep serving. 503 only when no group serves. Aborts go to the group the
request went to (the EngineClient that carries it sends them).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from typing import AsyncGenerator

from shuttle.common.block_hash import ROOT_HASH, block_hash
from shuttle.common.errors import GenerationError
from shuttle.common.messages import RequestOutput, SchedulerInfo, SchedulerStats, Submit
from shuttle.frontend.engine.api import GroupState
from shuttle.frontend.engine.client import ServingGroup

PREFIX_MAP_ENTRIES = 65536  # block digests remembered (16 bytes + an int each: a few MiB at most)


def prompt_block_hashes(prompt_token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained digests of the prompt's full blocks, as the scheduler's prefix cache names them."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, prompt_token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def aggregate_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Field by field sum of several groups' stats (per-step lists concatenated): the frontend's one-engine view."""
    total = SchedulerStats()
    for one in stats:
        for name in SchedulerStats.__struct_fields__:
            setattr(total, name, getattr(total, name) + getattr(one, name))
    # a per-position count is summed position by position (every group runs the same --speculative-config)
    total.spec_accepted_per_pos = [sum(column) for column in zip(*(s.spec_accepted_per_pos for s in stats))]
    return total


class Router:
    """Several serving groups behind frontend.engine_api.Engine.

    Args:
        groups: one ServingGroup (an EngineClient) per serving group; group i is groups[i].
        max_num_seqs: a group's batch size, the measure of "much busier" for affinity (module docstring).
        wait_for: how many leading groups `start()` waits for (the local ones; remote ones join when they answer).
    """

    def __init__(self, groups: list[ServingGroup], max_num_seqs: int = 128, wait_for: int | None = None):
        if not groups:
            raise ValueError("a router needs at least one serving group")
        self.groups = groups
        self.affinity_slack = max(max_num_seqs // 2, 1)
        self._wait_for = len(groups) if wait_for is None else wait_for
        # digest -> (group, that group's times_down when it was sent there): a group that went down since has an
        # empty prefix cache, so its old entries no longer attract requests.
        self._prefix: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._next = 0  # rotation among equal candidates
        self.affinity_hits = 0
        self.draining = False
        # the group the latest generate() call chose, read by the caller right after it (the event loop runs one
        # call at a time): its request's log lines and trace span name it
        self.last_group: int | None = None

    async def start(self, timeout: float = 120.0) -> SchedulerInfo | None:
        """Say Hello to every group; wait until one of the first `wait_for` groups (the local ones) answers. The
        others join as they answer: a frontend restarted while one group restarts too serves with the rest.

        Raises:
            TimeoutError: none of them answered within `timeout` seconds.
        """
        for group in self.groups:
            await group.start(timeout, wait=False)
        local = self.groups[:self._wait_for]
        if local:
            waiters = [asyncio.create_task(group.wait_up()) for group in local]
            try:
                done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            if not done:
                raise TimeoutError(f"no serving group answered within {timeout:g} s")
        return self.info

    # ---- what the handlers read -------------------------------------------------------------------------------

    @property
    def info(self) -> SchedulerInfo | None:
        return next((group.info for group in self.groups if group.info is not None), None)

    @property
    def stats(self) -> SchedulerStats:
        if len(self.groups) == 1:
            return self.groups[0].stats
        return aggregate_stats([group.stats for group in self.groups])

    @property
    def on_stats(self):
        return self.groups[0].on_stats

    @on_stats.setter
    def on_stats(self, callback) -> None:
        for group in self.groups:
            group.on_stats = callback

    @property
    def down_reason(self) -> str | None:
        """Why nothing serves (every group down), else None."""
        if any(group.is_up for group in self.groups):
            return None
        reasons = [f"group {i}: {g.down_reason}" for i, g in enumerate(self.groups) if g.down_reason]
        if len(self.groups) == 1:
            return self.groups[0].down_reason
        return "; ".join(reasons) or None

    @property
    def num_in_flight(self) -> int:
        return sum(group.num_in_flight for group in self.groups)

    def group_states(self) -> list[GroupState]:
        return [group.group_state(i) for i, group in enumerate(self.groups)]

    def admission_error(self) -> GenerationError | None:
        """503 while draining (no Retry-After: the server is going away) or while no group serves (Retry-After:
        the soonest group back), else None."""
        if self.draining:
            return GenerationError(503, "the server is shutting down", retry_after=None)
        errors = []
        for group in self.groups:
            error = group.admission_error()
            if error is None:
                return None
            errors.append(error)
        if all(error.retry_after is None for error in errors) and len(errors) > 1:  # none promises a time: say all
            return GenerationError(503, "no serving group takes requests: " + "; ".join(
                f"group {i}: {error}" for i, error in enumerate(errors)), retry_after=None)
        # a group's own drain (the router's is checked above) promises no time: it sorts last
        return min(errors, key=lambda e: e.retry_after if e.retry_after is not None else math.inf)

    def refusal_retry_after(self) -> float | None:
        """EngineClient.refusal_retry_after of the group a retry would go to (the least loaded that is up)."""
        error = self.admission_error()
        if error is not None:
            return error.retry_after
        up = [i for i, group in enumerate(self.groups) if group.is_up]
        return self.groups[min(up, key=self._load)].refusal_retry_after()

    # ---- routing ------------------------------------------------------------------------------------------------

    def _load(self, i: int) -> int:
        stats = self.groups[i].stats
        return max(stats.num_waiting + stats.num_running, self.groups[i].num_in_flight)

    def _kv_usage(self, i: int) -> float:
        stats = self.groups[i].stats
        return stats.num_blocks_in_use / max(stats.num_total_blocks, 1)

    def choose(self, hashes: list[bytes]) -> int:
        """The group for a new sequence whose prompt's full blocks have digests `hashes`.

        Raises:
            GenerationError: 503 when no group is up.
        """
        up = [i for i, group in enumerate(self.groups) if group.is_up]
        if not up:
            raise self.admission_error() or GenerationError(503, "no serving group is up; retry shortly",
                                                            retry_after=1.0)
        n = len(self.groups)
        least = min(up, key=lambda i: (self._load(i), self._kv_usage(i), (i - self._next) % n))
        self._next = (least + 1) % n
        for digest in reversed(hashes):  # the longest remembered prefix
            entry = self._prefix.get(digest)
            if entry is None:
                continue
            preferred, incarnation = entry
            if incarnation != self.groups[preferred].times_down:
                continue
            if preferred in up and self._load(preferred) - self._load(least) <= self.affinity_slack:
                self.affinity_hits += 1
                return preferred
            break
        return least

    def _remember(self, hashes: list[bytes], group: int) -> None:
        entry = (group, self.groups[group].times_down)
        for digest in hashes:
            self._prefix[digest] = entry
            self._prefix.move_to_end(digest)
        while len(self._prefix) > PREFIX_MAP_ENTRIES:
            self._prefix.popitem(last=False)

    def generate(self, request: Submit) -> AsyncGenerator[RequestOutput, None]:
        """The chosen group's own `generate` (its outputs, its aborts, its count of sequences in flight).

        Raises:
            GenerationError: 503 at once while the server drains or no group is up.
        """
        if self.draining:
            error = self.admission_error()
            assert error is not None  # draining refuses every request
            raise error
        if len(self.groups) == 1:  # nothing to choose: no prefix affinity to keep (the scheduler hashes the blocks)
            group = 0
        else:
            info = self.info
            hashes = prompt_block_hashes(request.prompt_token_ids, info.block_size) if info is not None else []
            group = self.choose(hashes)
            self._remember(hashes, group)
        self.groups[group].routed += 1
        self.last_group = group
        return self.groups[group].generate(request)

    # ---- supervision --------------------------------------------------------------------------------------------

    def engine_down(self, reason: str, retry_after: float, group: int = 0, restarting: bool = True) -> None:
        """The launcher says group `group` stopped: only its requests fail; the others keep serving."""
        if not 0 <= group < len(self.groups):
            return
        self.groups[group].engine_down(reason, retry_after, restarting=restarting)

    def fail_all(self, status: int, message: str) -> None:
        for group in self.groups:
            group.fail_all(status, message)

    def close(self) -> None:
        for group in self.groups:
            group.close()
