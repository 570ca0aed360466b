"""The engine as the frontend's handlers, drain and supervision see it: one declared interface.

`Engine` is implemented by frontend/engine/router.py's Router (every serving group: what `serve` runs) and by each
serving group alone (frontend/engine/client.py's ServingGroup: the EngineClient over its socket, and
tests/fake_engine.py's FakeEngine over a script, the one fake of it). tests/api/test_engine_api.py checks that all
three conform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncGenerator, Callable, Protocol, runtime_checkable

from shuttle.common.errors import GenerationError
from shuttle.common.messages import RequestOutput, SchedulerInfo, SchedulerStats, Submit


@dataclass
class GroupState:
    """One serving group as the frontend sees it, for /health and /metrics.

    Attributes:
        group: its index in the router. endpoint: its scheduler's requests endpoint. up: it takes new work.
        reason: why it is down (None while up). in_flight: this frontend's sequences there. times_down: failures
        seen since the frontend started. routed: sequences sent to it. stats: its scheduler's latest stats.
    """

    group: int
    endpoint: str
    up: bool
    reason: str | None
    in_flight: int
    times_down: int
    routed: int
    stats: SchedulerStats


@runtime_checkable
class Engine(Protocol):
    """What the frontend asks of the engine.

    Attributes:
        draining: set by the shutdown drain; new requests are refused (503 with no Retry-After).
        on_stats: called with every SchedulerStats message (the metrics' per-step histograms, the dashboard feed).
    """

    draining: bool
    on_stats: Callable[[SchedulerStats], None] | None

    @property
    def info(self) -> SchedulerInfo | None:
        """The scheduler's cache geometry (None until one answered)."""

    @property
    def stats(self) -> SchedulerStats:
        """The latest scheduler stats (summed over serving groups)."""

    @property
    def down_reason(self) -> str | None:
        """Why nothing serves, or None while something does."""

    @property
    def num_in_flight(self) -> int:
        """This frontend's sequences not yet finished."""

    def group_states(self) -> list[GroupState]:
        """Each serving group's state, in group order."""

    def admission_error(self) -> GenerationError | None:
        """The 503 a new request gets now (draining, or the engine down), or None: admit."""

    def refusal_retry_after(self) -> float | None:
        """Seconds a client whose request ended with a 503 should wait (None while draining: no promise)."""

    def generate(self, request: Submit) -> AsyncGenerator[RequestOutput, None]:
        """Submit `request`; its outputs until exactly one carries a finish_reason. Leaving early aborts it.

        Raises:
            GenerationError: 503 at once while draining or while no serving group is up.
        """

    def fail_all(self, status: int, message: str) -> None:
        """End every in-flight request with an error output, so each client gets a terminal answer."""

    def engine_down(self, reason: str, retry_after: float, group: int = 0, restarting: bool = True) -> None:
        """The launcher says serving group `group` stopped and is expected back in `retry_after` seconds (`restarting`
        False: it is not coming back, the launcher stops)."""
