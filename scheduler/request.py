"""A request as the scheduler tracks it from Submit to its terminal output."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shuttle.common.messages import TokenLogprobs
from shuttle.common.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, its KV blocks freed; resumes by recomputing prompt + output
    FINISHED = 3


@dataclass(eq=False)
class Request:
    """Scheduler-side state of one request.

    The scheduler books a step when it plans it: `num_computed_tokens` advances at schedule time, and a step whose
    chunk reaches the end of the known tokens adds a placeholder for the token it will sample
    (`num_output_placeholders`). The step's result settles the placeholder into `output_token_ids`. So
    `num_computed_tokens` chases `num_tokens_booked` (prompt + output + placeholders); a preemption resets both.

    Attributes:
        client: ZeroMQ identity of the frontend that gets this request's outputs.
        arrival_time: seconds (time.time()) when the frontend accepted the request.
        num_cached_tokens: prompt tokens served from the prefix cache at first scheduling (-1 before).
        epoch: how many times the request was preempted; a step planned in an earlier epoch is stale for it.
    """

    request_id: str
    client: bytes
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    priority: int = 0
    group: str = ""  # the client request it belongs to (scheduler/fairness.py)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1
    epoch: int = 0
    background: bool = False  # batch work (service class 1): ranks behind every interactive request
    rank: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the waiting queue's sort key, fixed at arrival (smaller first)
    status: RequestStatus = RequestStatus.WAITING
    first_scheduled_time: float = 0.0  # time.time() when first admitted to the running set
    deadline: float = float("inf")  # time.time() seconds after which the request ends with a timeout error
    has_output: bool = False  # an output was sent (the first one carries the once-only fields)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # gathered over prefill chunks
    spec_misses: int = 0  # speculative steps in a row whose drafts were all rejected (scheduler/speculation_book.py)
    spec_pause: int = 0  # decode steps left before it drafts again after such misses
    lora_name: str = ""  # its LoRA adapter ("" = the base model)
    lora_key: str = ""  # what names the adapter's weights in prefix-cache digests ("" = the base model)
    lora_slot: int = -1  # the adapter slot it holds while running (scheduler/lora_slots.py; -1: none)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens whose ids are known."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_booked(self) -> int:
        """Known tokens plus the ones that steps in flight will sample."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_live(self) -> bool:
        return self.status != RequestStatus.FINISHED
