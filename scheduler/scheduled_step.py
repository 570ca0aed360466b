"""What the scheduler remembers of a planned step, to settle its result (and what SLO admission times)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shuttle.common.messages import StepPlan
from shuttle.scheduler.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a planned step: tokens [start, start + num_new) are computed, and the request
    samples a token when `samples` (its chunk reaches the end of its booked tokens). With drafts, tokens [start,
    start + num_new) are the last known token then the drafts, and the step gains 1 to num_new tokens."""

    request: Request
    epoch: int
    start: int
    num_new: int
    samples: bool
    draft_token_ids: tuple[int, ...] = ()  # n-gram drafts verified after the last known token (num_new = 1 + len)


@dataclass
class ScheduledStep:
    """What the scheduler remembers of a planned step, to settle its result."""

    plan: StepPlan
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    num_prompt_tokens: int = 0  # of the scheduled tokens, how many are prompt (prefill) tokens
    num_decode_tokens: int = 0  # of the scheduled tokens, how many are decodes (one sampled token's successor)
    sent_at: float = 0.0  # time.monotonic() when the loop sent its plan (the step watchdog times it)

    @property
    def num_scheduled(self) -> dict[str, int]:
        """request id -> tokens computed in this step."""
        return {rid: s.num_new for rid, s in self.scheduled.items()}

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled.values())

    @property
    def sampling_ids(self) -> list[str]:
        """Ids of the requests that sample a token in this step, in plan order."""
        return [rid for rid, s in self.scheduled.items() if s.samples]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.plan.finished_ids
