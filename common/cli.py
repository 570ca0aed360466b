"""The `shuttle` command. `shuttle serve [MODEL_DIR]` starts a serving group (see common/launcher.py); `shuttle plan`
prints the memory plan; `shuttle batch INPUT OUTPUT` runs an OpenAI batch file (see common/batch_file.py)."""

from __future__ import annotations

import argparse
import re
import sys

from common.config import DEFAULT_MODEL_DIR, CacheConfig, OpsConfig, SchedulerConfig, WorkerConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1048576' -> bytes. Raises argparse.ArgumentTypeError."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _origins(text: str) -> tuple[str, ...]:
    """'https://a.example,https://b.example' -> a tuple of origins; '*' allows any."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not re.match(r"^https?://[^/\s]+$", origin):
            raise argparse.ArgumentTypeError(f"not an origin: {origin!r} (scheme://host[:port], or *)")
    return origins


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shuttle", description="LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start frontend, scheduler and worker on one model",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    default_model = str(DEFAULT_MODEL_DIR) if DEFAULT_MODEL_DIR.is_dir() else None
    serve.add_argument("model_dir", nargs="?", default=default_model, metavar="MODEL_DIR",
                       help="Hugging Face model directory (config.json, safetensors, tokenizer.json)")
    serve.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--served-model-name", default=None,
                       help="the `model` name clients use; None means the model directory's name")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="weights and KV cache dtype")
    serve.add_argument("--max-model-len", type=_positive, default=None, help="default: the model's position limit")
    sched, cache = SchedulerConfig(), CacheConfig()
    serve.add_argument("--max-num-seqs", type=_positive, default=sched.max_num_seqs,
                       help="most sequences in one step")
    serve.add_argument("--max-num-batched-tokens", type=_positive, default=sched.max_num_batched_tokens,
                       help="most tokens in one step; longer prompts are prefilled in chunks")
    serve.add_argument("--max-waiting-requests", type=_positive, default=sched.max_waiting_requests,
                       help="past this many queued requests, new ones get HTTP 503")
    serve.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=sched.scheduling_policy,
                       help="fcfs: arrival order; priority: the request field `priority`, lower first, with aging")
    serve.add_argument("--priority-aging-seconds", type=float, default=sched.priority_aging_seconds,
                       help="under --scheduling-policy priority: seconds of waiting worth one priority level "
                            "(0 turns aging off)")
    serve.add_argument("--request-timeout", type=float, default=sched.request_timeout,
                       help="seconds from arrival after which an unfinished request ends with an error "
                            "(0: never; a request's own `timeout` field can ask for less or more)")
    serve.add_argument("--max-seqs-per-request", type=int, default=sched.max_seqs_per_request,
                       help="running sequences one client request (its prompts x n) may hold; 0: a fair share "
                            "(max_num_seqs / live requests; max_num_seqs less one eighth when alone)")
    serve.add_argument("--long-prefill-token-threshold", type=int, default=sched.long_prefill_token_threshold,
                       help="while others wait, one prefill chunk takes at most this many tokens of a step "
                            "(None: a quarter of --max-num-batched-tokens; 0: no cap)")
    serve.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=sched.async_scheduling,
                       help="plan the next step while the worker runs the current one (two steps in flight); "
                            "--no-async-scheduling plans, waits and settles one step at a time")
    serve.add_argument("--ttft-slo-ms", type=float, default=sched.ttft_slo_ms,
                       help="TTFT objective (ms): a request predicted to miss it is refused at once with 503 and "
                            "Retry-After (0: off; a request's `ttft_slo_ms` field sets its own)")
    serve.add_argument("--step-cost-profile", default=sched.step_cost_profile, metavar="JSON",
                       help="calibrated step-cost profile (scripts/calibrate.py) for --ttft-slo-ms; without one the "
                            "cost model is fitted online to the server's own steps")
    serve.add_argument("--block-size", type=_positive, default=cache.block_size, help="tokens per KV block")
    serve.add_argument("--num-kv-blocks", type=_positive, default=None,
                       help="fixed number of KV blocks (overrides --kv-cache-memory)")
    serve.add_argument("--kv-cache-memory", type=parse_bytes, default=cache.kv_cache_memory,
                       help="bytes for the KV cache, e.g. 512MiB")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=cache.enable_prefix_caching, help="share KV blocks of identical prompt prefixes")
    serve.add_argument("--attention-backend", choices=["auto", "cpu", "reference"],
                       default=WorkerConfig().attention_backend,
                       help="auto: cpu on a CPU; cpu: numba paged decode kernel + per-sequence prefill; reference: "
                            "one sequence at a time with torch SDPA")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="Jinja chat template overriding the one in tokenizer_config.json")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics and on "
                            "batch jobs (default: $SHUTTLE_API_KEY; prefer it or --api-key-file: a command line "
                            "is visible to every user of the machine)")
    serve.add_argument("--api-key-file", default=None, metavar="FILE",
                       help="read the API key from the first line of FILE")
    serve.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                       help="comma-separated origins (e.g. https://app.example) whose browser pages may call the API "
                            "and open the WebSocket: CORS headers and preflight answers for them; '*' allows any "
                            "origin; None: no CORS headers, and WebSockets only from the server's own host")
    serve.add_argument("--batch-endpoint", default=None,
                       help="ZeroMQ endpoint for batch clients (default: tcp://127.0.0.1:PORT+1, loopback even with "
                            "--host 0.0.0.0; 'none' disables)")
    serve.add_argument("--batch-background", action=argparse.BooleanOptionalAction, default=True,
                       help="run batch jobs behind every interactive (HTTP, WebSocket) request under either "
                            "--scheduling-policy, so a running batch job does not raise interactive TTFT; "
                            "--no-batch-background schedules them like interactive requests")
    serve.add_argument("--zmq-transport", choices=["ipc", "tcp"], default="ipc",
                       help="ipc:// sockets in a private runtime directory, or tcp:// on loopback authenticated "
                            "with ZeroMQ CURVE keys made for each launch")
    ops = OpsConfig()
    serve.add_argument("--step-timeout", type=_seconds, default=ops.step_timeout,
                       help="seconds the scheduler waits for one step of the worker before it declares the worker "
                            "hung; the engine then restarts (0: never)")
    serve.add_argument("--heartbeat-timeout", type=_seconds, default=ops.heartbeat_timeout,
                       help="seconds without a heartbeat after which the launcher declares a process hung and "
                            "restarts it (0: never)")
    serve.add_argument("--max-restarts", type=_count, default=ops.max_restarts,
                       help="restarts in a row of the engine (scheduler + worker) or of the frontend before the "
                            "launcher gives up and exits 1 (0: exit at the first failure)")
    serve.add_argument("--shutdown-timeout", type=_seconds, default=ops.shutdown_timeout,
                       help="on SIGTERM, seconds in-flight requests may take to finish before they end with an error")
    serve.add_argument("--keep-alive-timeout", type=_seconds, default=ops.keep_alive_timeout,
                       help="seconds an idle HTTP connection is kept open")
    serve.add_argument("--header-timeout", type=_seconds, default=ops.header_timeout,
                       help="seconds a client has to finish sending a request head it has started")
    serve.add_argument("--body-timeout", type=_seconds, default=ops.body_timeout,
                       help="seconds a client has to send the request body after its head (else HTTP 408)")
    serve.add_argument("--debug-step-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    _add_plan_parser(commands, default_model)
    from common.batch_file import add_parser as add_batch_parser
    add_batch_parser(commands)
    return parser


def _unit_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _add_plan_parser(commands, default_model: str | None) -> None:
    """`shuttle plan`: the memory plan and the concurrency table, measured without starting a server."""
    plan = commands.add_parser("plan", help="memory plan and how many requests fit (never starts the server)",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sched, cache = SchedulerConfig(), CacheConfig()
    plan.add_argument("model_dir", nargs="?", default=default_model, metavar="MODEL_DIR")
    plan.add_argument("--max-model-len", type=_positive, default=None, help="default: the model's position limit")
    plan.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    budget = plan.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                        help=f"bytes for the KV cache (default {cache.kv_cache_memory // 2**30}GiB, as shuttle serve)")
    budget.add_argument("--gpu-memory-utilization", type=_unit_fraction, default=None,
                        help="share of a CUDA device's memory for weights, activations and KV (CUDA devices only)")
    budget.add_argument("--num-kv-blocks", type=_positive, default=None, help="a fixed number of KV blocks")
    plan.add_argument("--block-size", type=_positive, default=cache.block_size)
    plan.add_argument("--max-num-seqs", type=_positive, default=sched.max_num_seqs)
    plan.add_argument("--max-num-batched-tokens", type=_positive, default=sched.max_num_batched_tokens)
    plan.add_argument("--max-waiting-requests", type=_positive, default=sched.max_waiting_requests)
    plan.add_argument("--attention-backend", choices=["auto", "cpu", "reference"],
                      default=WorkerConfig().attention_backend)
    plan.add_argument("--no-measure-processes", action="store_true",
                      help="skip measuring the frontend and scheduler processes (two short subprocesses)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from common.launcher import serve
        return serve(args)
    if args.command == "plan":
        from capacity.memory_plan import main as plan
        return plan(args)
    if args.command == "batch":
        from common.batch_file import run as batch
        return batch(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
