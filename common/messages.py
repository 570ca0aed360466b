"""Every message on shuttle's sockets, grouped by channel; one tagged union per channel.

Structs are array_like (positional on the wire), omit defaults and skip GC tracking. New fields are only
ever appended, with defaults, so an older peer still decodes a newer message. In code they are built with keywords
only (kw_only): positional on the wire, never in a constructor call, where two swapped fields of one type would be a
silent bug.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from shuttle.common.sampling import SamplingParams, StructuredOutput

_WIRE = dict(array_like=True, omit_defaults=True, gc=False, tag=True, kw_only=True)


class FinishReason(enum.IntEnum):
    """Why a request ended. ERROR carries an HTTP-like status and message in the output."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    @property
    def openai_name(self) -> str:
        return ("stop", "length", "abort", "error")[self]


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """Log-probabilities (natural log, of the model's raw distribution) around one sampled or prompt token.
    `rank`: how many tokens of the vocabulary have a logprob at least the token's own (1: the most likely; vLLM's
    rank; 0 where a test's fabricated output leaves it out)."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0


# ---- frontend -> scheduler (DEALER -> ROUTER) -------------------------------------------------------------

class Submit(msgspec.Struct, **_WIRE):
    """A new request. `arrival_time` is the frontend's time.time() in seconds; `timeout` (seconds from
    arrival, 0 = the server's --request-timeout) ends the request with an error if it is still unfinished."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    priority: int = 0
    timeout: float = 0.0
    group_id: str = ""  # the client request this sequence belongs to (fair shares); "" = its own request_id
    ttft_slo_ms: float = 0.0  # the request's own TTFT objective (0: the server's --ttft-slo-ms, if any)
    background: bool = False  # batch work: waits behind every interactive request, under either policy
    lora_name: str = ""  # the LoRA adapter the request runs through (--lora-modules); "" = the base model
    lora_path: str = ""  # that adapter's directory (the frontend's registry names it: runtime loads included)
    lora_load_id: str = ""  # which load of it ("" for --lora-modules): a reload is new weights to slots and cache


class Abort(msgspec.Struct, **_WIRE):
    """The client is gone or cancelled: free these requests' blocks now. Unknown ids are ignored."""

    request_ids: list[str]


class Hello(msgspec.Struct, **_WIRE):
    """A frontend announces itself so the scheduler can send it stats before it submits anything."""


class Heartbeat(msgspec.Struct, **_WIRE):
    """"I am alive": a frontend to its scheduler (one that falls silent is gone, and its requests are aborted),
    and every child to the launcher (one that falls silent is hung, and is restarted)."""

    name: str = ""
    pid: int = 0


FrontendMessage = Submit | Abort | Hello | Heartbeat


# ---- scheduler -> frontend (ROUTER -> DEALER) -------------------------------------------------------------

class RequestOutput(msgspec.Struct, **_WIRE):
    """What one request gained in one step.

    Attributes:
        new_token_ids: tokens sampled this step (usually one; none for an error).
        finish_reason: set on the request's last output, exactly once.
        num_cached_tokens: prompt tokens found in the prefix cache (sent on the first output).
        error_status: HTTP-like status when finish_reason is ERROR (400 never fits, 503 queue full, 500).
    """

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    error_status: int = 0
    error_message: str = ""
    logprobs: list[TokenLogprobs] = []  # one per new token, when the request asked for logprobs
    first_scheduled_time: float = 0.0  # time.time() when the request left the queue (on its first output)
    prompt_logprobs: list[TokenLogprobs] = []  # prompt tokens 1.. (on the first output), if asked
    retry_after_s: float = 0.0  # with a 503: seconds after which a retry should succeed (0: unknown)
    rejection: str = ""  # why a request was refused at arrival when that is not told by the status ("slo")


class SchedulerStats(msgspec.Struct, **_WIRE):
    """Scheduler state for /health and metrics; sent after any step or queue change, never waited for."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    num_rejected: int = 0
    num_timed_out: int = 0
    num_blocks_in_use: int = 0
    # Per step since the previous stats message: sequences and tokens scheduled (for the per-step histograms).
    step_batch_sizes: list[int] = []
    step_token_counts: list[int] = []
    # Cumulative: requests that left the waiting queue (resumed preemptions included), and tokens scheduled;
    # their rates let the frontend predict how long a refused client must wait (Retry-After).
    num_admitted: int = 0
    num_scheduled_tokens: int = 0
    # Per step, aligned with step_token_counts: how many of its tokens were decodes (one token a request, its
    # input the token sampled before); the rest were prefill (prompt chunks, recomputation after preemption).
    step_decode_token_counts: list[int] = []
    # Cumulative, under --speculative-config (vLLM's spec_decode counters): sequence-steps that verified drafts,
    # drafts verified, drafts accepted, and drafts accepted at each draft position (index 0: the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Under --enable-lora: the adapters running requests use, and those waiting requests name (vLLM's
    # lora_requests_info labels)
    lora_running: list[str] = []
    lora_waiting: list[str] = []


class StepOutputs(msgspec.Struct, **_WIRE):
    """All outputs for one frontend from one step (or from one admission decision), with the scheduler's stats
    after it riding along (None when unchanged since the last message to this frontend)."""

    outputs: list[RequestOutput]
    stats: SchedulerStats | None = None


class SchedulerInfo(msgspec.Struct, **_WIRE):
    """Answer to Hello: the cache geometry the frontend needs to validate requests. Sent again with `draining` to
    every frontend when a `shuttle engine` drains (SIGTERM): it takes no new request, those in flight finish, then
    it exits; the frontends route around it meanwhile."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    draining: bool = False
    lora: bool = False  # its scheduler serves LoRA adapters (--enable-lora)


SchedulerMessage = StepOutputs | SchedulerStats | SchedulerInfo


# ---- scheduler -> worker (PUSH -> PULL) -------------------------------------------------------------------

class NewRequestData(msgspec.Struct, **_WIRE):
    """First time the worker sees a request (or again after a preemption): everything it keeps for the request's
    life. `token_ids` are the prompt followed by the outputs known so far; the first `prompt_len` are the prompt
    (0: all of them)."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    prompt_len: int = 0
    lora_slot: int = -1  # the worker's adapter slot this request's rows use (-1: the base model)


class CachedRequestData(msgspec.Struct, **_WIRE):
    """A request the worker already holds: only what changed since the last step. The step computes tokens
    [num_computed_tokens, num_computed_tokens + num_scheduled_tokens); a decode's input token is the one the
    worker itself sampled in the previous step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    # n-gram drafts (--speculative-config): the step computes the last known token then these, and verifies them
    # (num_scheduled_tokens is 1 + their number)
    draft_token_ids: list[int] = []


class LoRALoad(msgspec.Struct, **_WIRE):
    """Load the adapter `name` (a PEFT directory at `path`) into the worker's adapter slot `slot`, replacing what
    the slot held (no running request uses it any more)."""

    slot: int
    name: str
    path: str


class StepPlan(msgspec.Struct, **_WIRE):
    """One forward pass. The worker forgets `finished_ids` before the step (finished, aborted or preempted: a
    preempted request comes back later as a new request with all its known tokens), and loads `lora_loads` before
    it runs."""

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    finished_ids: list[str] = []
    lora_loads: list[LoRALoad] = []


class Shutdown(msgspec.Struct, **_WIRE):
    """Stop the worker loop."""


# Words in an engine's 400 that tell the frontend which request field it is about (frontend/generation.py): a
# constraint the grammar engine refused (worker/grammar.py), a prompt + max_tokens no cache holds (the scheduler).
CONSTRAINT_REFUSAL = "constraint does not compile"
NEVER_FITS = "tokens of KV cache"

# Bounds on the compiled grammars no queued or running request needs, kept in the worker for their next requests;
# the scheduler decides what goes (scheduler/grammar_gate.py). One large enum schema compiles to tens of MiB.
GRAMMAR_CACHE_ENTRIES = 512
GRAMMAR_CACHE_BYTES = 256 * 2**20


class CompileGrammars(msgspec.Struct, **_WIRE):
    """To rank 0 only, before any plan holding a request with one of these constraints: drop the compiled grammars
    keyed `evict` (first), then compile `specs` off the step loop; each spec is answered by a GrammarsCompiled
    (cache hits too). The worker keeps every compiled grammar until it is evicted here."""

    specs: list[StructuredOutput]
    evict: list[str] = []


PlanMessage = StepPlan | Shutdown | CompileGrammars


# ---- worker -> scheduler (PUSH -> PULL) -------------------------------------------------------------------

class WorkerReady(msgspec.Struct, **_WIRE):
    """Sent once after the model and KV cache are allocated. Sizes in bytes.

    Attributes:
        device, dtype, attention_backend: what the rank runs on and with ("cuda:0", "bfloat16", "flex").
        activation_peak_bytes: the profiling step's torch peak on CUDA (0: not profiled, as on the CPU).
        kv_budget: how the KV cache was sized ("--kv-cache-memory 1024 MiB", "--gpu-memory-utilization 0.9 of ...").
        boot_id, pid: the host's boot id and the worker's process id; the scheduler's step watchdog reads that
            process's CPU time to tell slow from hung.
    """

    rank: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    weight_bytes: int
    device: str = ""
    dtype: str = ""
    attention_backend: str = ""
    activation_peak_bytes: int = 0
    kv_budget: str = ""
    boot_id: str = ""
    pid: int = 0


class RequestFailure(msgspec.Struct, array_like=True, gc=False):
    """A request the worker could not run on: the scheduler ends it with this error alone, the rest of the step
    standing (500: its adapter could not be loaded, and it was left out of the step; 400: its constraint admits no
    token, and its token of this step is left out of the result; 500: its logits were NaN or +inf)."""

    request_id: str
    message: str
    status: int = 500


class StepResult(msgspec.Struct, **_WIRE):
    """Sampled tokens of one step: `request_ids[i]` sampled `token_ids[i]`. Requests whose chunk did not
    reach the end of their known tokens sample nothing and are absent. A request that verified drafts appears once
    per token it gained (its accepted drafts, then the target's token), in order."""

    step_id: int
    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = []  # aligned with request_ids when any request asked
    prompt_logprobs: list[PromptLogprobs] = []  # for requests with prompt_logprobs whose prefill ran this step
    failed: list[RequestFailure] = []  # requests that ended in this step with an error of their own


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """Logprobs of consecutive prompt tokens computed in one step: entries[i] is the logprob of prompt token
    start + 1 + i (the first prompt token has none)."""

    request_id: str
    entries: list[TokenLogprobs]
    start: int = 0


class WorkerFailed(msgspec.Struct, **_WIRE):
    """The step raised; the scheduler fails the step's requests and the worker goes on."""

    step_id: int
    message: str


class GrammarsCompiled(msgspec.Struct, **_WIRE):
    """Answers to CompileGrammars, sent whenever compiles finish (between steps or while idle): `errors[i]` is ""
    when the constraint keyed `keys[i]` (StructuredOutput.key) compiled, else why it cannot (its requests get 400,
    or `statuses[i]` when given: 503 for "not now");
    `sizes[i]`: the compiled grammar's bytes in the worker (0 for an error)."""

    keys: list[str]
    errors: list[str]
    sizes: list[int] = []
    statuses: list[int] = []


WorkerMessage = WorkerReady | StepResult | WorkerFailed | GrammarsCompiled


# ---- batch client <-> frontend (DEALER -> ROUTER) ------------------------------------------------------------

# Maps, not arrays, on this channel: a client is any program (not one of ours), and a wrong field must be
# named in its error result; a tag field "type" tells the messages apart.
_BATCH_WIRE = dict(omit_defaults=True, tag_field="type", kw_only=True)


class BatchRequest(msgspec.Struct, tag="request", forbid_unknown_fields=True, **_BATCH_WIRE):
    """One job: the body of a POST to `url` (/v1/completions or /v1/chat/completions), exactly as over HTTP.

    `job_id` is the client's own (the batch file's custom_id); its one BatchResponse comes back under it, in
    completion order. A second job with the id of one still running from the same client is refused (400).
    `api_key` is required when the server has one (else 401, and no work is done).
    """

    job_id: str
    url: str
    body: Any
    api_key: str = ""


class BatchPing(msgspec.Struct, tag="ping", forbid_unknown_fields=True, **_BATCH_WIRE):
    """The client's heartbeat (also its first message): a client silent for a few seconds is taken as gone and
    its running jobs are aborted."""


BatchClientMessage = BatchRequest | BatchPing


BATCH_MAX_DEPTH = 128  # nesting levels a batch message may have (HTTP bodies of the same jobs need well under 20)


class BatchResponse(msgspec.Struct, tag="response", **_BATCH_WIRE):
    """A job's one terminal answer: `status_code` and `body` as an HTTP call would have got them (200 and the
    completion or chat completion; else the status and an OpenAI error body naming the field). `request_id` is
    the response's id (cmpl-..., chatcmpl-...). With 503, `retry_after` is seconds after which a retry is
    expected to be admitted, and `should_retry` False when the server is shutting down (HTTP's x-should-retry:
    false): no retry will be admitted by this server."""

    job_id: str
    status_code: int
    body: Any
    request_id: str = ""
    retry_after: float = 0.0
    should_retry: bool = True


class BatchHeartbeat(msgspec.Struct, tag="heartbeat", **_BATCH_WIRE):
    """The server's heartbeat to each client it has heard from: a client that hears nothing for a few seconds
    takes the server as gone (instead of waiting forever). `instance` names the endpoint's life: when it changes
    (the frontend restarted within the client's timeout), the jobs the old one held are lost and are sent again."""

    instance: str = ""


BatchServerMessage = BatchResponse | BatchHeartbeat


# ---- any child -> launcher (PUSH -> PULL) -----------------------------------------------------------------

class ProcessReady(msgspec.Struct, **_WIRE):
    """A child finished starting. `info` carries figures the launcher prints (capacity, URL)."""

    name: str
    pid: int
    info: dict[str, int | float | str] = {}


ControlMessage = ProcessReady | Heartbeat


# ---- launcher -> frontend (PUSH -> PULL) ------------------------------------------------------------------

class EngineDown(msgspec.Struct, **_WIRE):
    """A serving group's engine (scheduler + worker) stopped: end that group's in-flight requests with an error
    and route nothing to it until its new scheduler answers Hello (503 only when no group serves). `retry_after`:
    the launcher's estimate of seconds until it serves again; `restarting` False: it will not (the launcher gave
    up after --max-restarts, or is stopping), so nothing tells the clients to retry."""

    reason: str
    retry_after: float = 1.0
    group: int = 0  # which serving group (data parallelism); the others keep serving
    restarting: bool = True


SupervisorMessage = EngineDown
