"""Frozen configuration shared by the launcher and every process.

The launcher resolves everything that needs a look at the model directory (max_model_len, end-of-sequence
ids) once, then hands the same `ShuttleConfig` to each child as JSON, so no two processes can disagree.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from common.errors import ModelDirError

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"


@dataclass(frozen=True)
class ModelConfig:
    """What the frontend, scheduler and worker need to know about the served model.

    Attributes:
        model_dir: Hugging Face model directory (config.json, weights, tokenizer files).
        served_model_name: the name clients give in the ``model`` field.
        max_model_len: longest context in tokens (prompt + output).
        eos_token_ids: ids that end a sequence, from generation_config.json (else config.json).
        dtype: torch dtype name of weights and KV cache ("float32", "bfloat16", "float16").
    """

    model_dir: str
    served_model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str = "float32"

    @staticmethod
    def from_dir(model_dir: str | os.PathLike, max_model_len: int | None = None,
                 served_model_name: str | None = None, dtype: str = "float32") -> "ModelConfig":
        """Read config.json (and generation_config.json if present) from `model_dir`.

        Raises:
            ModelDirError: the directory or config.json is missing or malformed, or max_model_len exceeds
                the model's position limit.
        """
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelDirError(f"model directory {str(path)!r} does not exist")
        hf_config = _read_json(path / "config.json")
        generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
        limit = context_limit(hf_config)
        if max_model_len is None:
            if limit is None:
                raise ModelDirError(f"{path / 'config.json'} names no context limit ({', '.join(CONTEXT_LIMIT_KEYS)}); "
                                    f"pass --max-model-len")
            max_model_len = limit
        elif limit is not None and not 0 < max_model_len <= limit:
            raise ModelDirError(f"--max-model-len {max_model_len} is outside 1..{limit} for this model")
        eos = generation.get("eos_token_id", hf_config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return ModelConfig(
            model_dir=str(path.resolve()),
            served_model_name=served_model_name or path.name,
            max_model_len=max_model_len,
            eos_token_ids=eos_ids,
            dtype=dtype,
        )


# Names architectures give their position limit, in the order vLLM's and transformers' configs are read.
CONTEXT_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len",
                      "n_ctx", "max_seq_length")


def context_limit(hf_config: dict) -> int | None:
    """The model's position limit in tokens from its config.json (or its text_config), None if it names none."""
    for config in (hf_config, hf_config.get("text_config") or {}):
        for key in CONTEXT_LIMIT_KEYS:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _batch_endpoint(args: argparse.Namespace) -> str:
    """--batch-endpoint, else tcp://127.0.0.1:(PORT + 1) (any free port when --port is 0); "none" disables it.

    Loopback even with --host 0.0.0.0: batch jobs run unmetered work, so exposing them is a separate decision.
    """
    if args.batch_endpoint:
        return "" if args.batch_endpoint == "none" else args.batch_endpoint
    return f"tcp://127.0.0.1:{args.port + 1 if args.port else '*'}"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelDirError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} does not hold a JSON object")
    return data


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: fixed number of blocks; ``None`` lets the worker size the cache from kv_cache_memory.
        kv_cache_memory: bytes the worker may spend on K and V for all layers.
        enable_prefix_caching: share full blocks of identical prefixes between requests.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets of the scheduler.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens (prefill chunks + decodes) in one step.
        max_waiting_requests: bound of the waiting queue; a submit past it is rejected (HTTP 503).
        scheduling_policy: "fcfs" (arrival order) or "priority" (request field `priority`, lower first).
        priority_aging_seconds: under "priority", seconds of waiting worth one priority level (0: no aging).
        request_timeout: seconds from arrival after which an unfinished request ends with an error (0: never).
        async_scheduling: plan step N+1 while the worker runs step N (at most two steps in flight).
        max_seqs_per_request: running sequences one client request (its prompts x n) may hold; 0 = a fair share
            (max_num_seqs / live requests, or max_num_seqs less one eighth when alone).
        long_prefill_token_threshold: while other requests wait, one request's prefill chunk takes at most this many
            tokens of a step, so short prompts get their first token while a long one is chunked (vLLM's name);
            None: a quarter of max_num_batched_tokens; 0: no cap.
        ttft_slo_ms: TTFT objective in ms; a request predicted to miss it is refused at arrival with 503
            (scheduler/admission.py). 0: no objective (requests may still carry their own).
        step_cost_profile: JSON step-cost profile (scripts/calibrate.py) for that prediction; "" fits the cost
            model online to the server's own steps.
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_waiting_requests: int = 4096
    scheduling_policy: str = "fcfs"
    priority_aging_seconds: float = 10.0
    request_timeout: float = 0.0
    async_scheduling: bool = True
    max_seqs_per_request: int = 0
    long_prefill_token_threshold: int | None = None
    ttft_slo_ms: float = 0.0
    step_cost_profile: str = ""


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker executes steps.

    Attributes:
        attention_backend: "auto" (cpu on a CPU), "cpu" (numba paged decode kernel + per-sequence prefill) or
            "reference" (one sequence at a time with torch SDPA).
    """

    attention_backend: str = "auto"


@dataclass(frozen=True)
class OpsConfig:
    """Supervision, shutdown and connection limits (issue 9).

    Attributes:
        step_timeout: seconds the scheduler waits for one step's result before it declares the worker hung
            and exits so that the launcher restarts the engine (0: wait forever).
        heartbeat_timeout: seconds without a heartbeat after which the launcher declares a process hung.
        max_restarts: restarts of the engine (scheduler + worker) or of the frontend in a row before the
            launcher gives up and exits 1; a process group that then serves for RESTART_RESET_S starts afresh.
        shutdown_timeout: seconds SIGTERM lets in-flight requests finish before they end with an error.
        keep_alive_timeout: seconds an idle HTTP connection stays open.
        header_timeout: seconds a client has to send a whole request head once it has started one.
        body_timeout: seconds a client has to send the request body once the head has arrived.
    """

    step_timeout: float = 60.0
    heartbeat_timeout: float = 30.0
    max_restarts: int = 5
    shutdown_timeout: float = 30.0
    keep_alive_timeout: float = 15.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0


@dataclass(frozen=True)
class IpcConfig:
    """ZeroMQ endpoints. ipc:// paths live in a private 0700 runtime directory made by the launcher.

    Attributes:
        requests: scheduler ROUTER that frontends' DEALERs connect to (Submit/Abort in, outputs back).
        plans: scheduler PUSH -> worker PULL, one StepPlan per step.
        results: worker PUSH -> scheduler PULL, one StepResult per step plus start-up reports.
        control: launcher PULL that every child reports readiness and heartbeats to.
        supervisor: frontend PULL that the launcher tells engine failures to (ipc, in the runtime directory).
        curve: with tcp transport, the sockets above that cross tcp use ZeroMQ CURVE; the per-launch keys
            travel in the environment (SHUTTLE_CURVE_KEYS), never on a command line.
    """

    requests: str
    plans: str
    results: str
    control: str
    supervisor: str = ""
    curve: bool = False

    @staticmethod
    def in_directory(runtime_dir: str) -> "IpcConfig":
        return IpcConfig(*(f"ipc://{runtime_dir}/{name}.sock"
                           for name in ("requests", "plans", "results", "control", "supervisor")))


@dataclass(frozen=True)
class ShuttleConfig:
    """Everything one serving group needs; built once by the launcher from the command line."""

    model: ModelConfig
    ipc: IpcConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    # Test-only: seconds the worker sleeps in every step, to show the frontend never waits on the model.
    debug_step_delay: float = 0.0
    chat_template: str | None = None  # Jinja file overriding the tokenizer's chat template
    batch_endpoint: str = ""  # ZeroMQ endpoint for batch clients ("" = none)
    # Origins whose browser pages may call the API (CORS) and open the WebSocket; "*" is any origin; empty: no CORS
    # headers at all, and WebSockets only from the server's own host.
    allowed_origins: tuple[str, ...] = ()
    ops: OpsConfig = field(default_factory=OpsConfig)
    # Batch jobs run behind every interactive request (the scheduler's background class) unless this is False.
    batch_background: bool = True

    @staticmethod
    def from_args(args: argparse.Namespace, ipc: IpcConfig) -> "ShuttleConfig":
        """Build from `shuttle serve` arguments (see common/cli.py). Raises ModelDirError."""
        model = ModelConfig.from_dir(args.model_dir, args.max_model_len, args.served_model_name, args.dtype)
        if args.step_cost_profile:  # a bad profile is a one-line error now, not a scheduler traceback later
            from common.step_cost import StepCostModel
            try:
                StepCostModel.load(args.step_cost_profile)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelDirError(f"--step-cost-profile {args.step_cost_profile}: {exc}") from None
        max_batched = args.max_num_batched_tokens
        return ShuttleConfig(
            model=model,
            ipc=ipc,
            cache=CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory, args.enable_prefix_caching),
            scheduler=SchedulerConfig(args.max_num_seqs, max_batched, args.max_waiting_requests,
                                      args.scheduling_policy, args.priority_aging_seconds, args.request_timeout,
                                      args.async_scheduling, args.max_seqs_per_request,
                                      args.long_prefill_token_threshold, args.ttft_slo_ms,
                                      args.step_cost_profile),
            worker=WorkerConfig(args.attention_backend),
            host=args.host,
            port=args.port,
            debug_step_delay=args.debug_step_delay,
            chat_template=args.chat_template,
            batch_endpoint=_batch_endpoint(args),
            allowed_origins=tuple(args.allowed_origins or ()),
            ops=OpsConfig(args.step_timeout, args.heartbeat_timeout, args.max_restarts, args.shutdown_timeout,
                          args.keep_alive_timeout, args.header_timeout, args.body_timeout),
            batch_background=getattr(args, "batch_background", True),
        )

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @staticmethod
    def from_json(text: str) -> "ShuttleConfig":
        return msgspec.json.decode(text, type=ShuttleConfig)
