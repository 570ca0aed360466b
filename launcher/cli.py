"""The `shuttle` command. `shuttle serve [MODEL_DIR]` starts a frontend and its serving groups (see
launcher/launcher.py); `shuttle engine --listen ENDPOINT` one serving group for a frontend on another host;
`shuttle plan` prints the memory plan without starting one (capacity/memory_plan.py); `shuttle batch INPUT OUTPUT`
runs an OpenAI batch file against a server (batch_jobs/batch_file.py). The capacity tools parse their own flags
(TOOLS): `shuttle calibrate` writes the step-cost profile that `--step-cost-profile` reads, `shuttle simulate`
predicts a workload from it, `shuttle tune` chooses the step budgets for objectives, `shuttle bench` measures a
running server.

The engine's flags are derived from the config sections' field declarations (common/config.py `option`), so a
flag's default and help live in one place.
"""

from __future__ import annotations

import argparse
import os
import sys

from shuttle.common.arg_types import (
    LOG_LEVELS,
    add_config_options,
    chat_template,
    count,
    dtype_name,
    json_object,
    logprobs_cap,
    origins,
    parse_bytes,
    positive,
    seed,
    served_name,
    token_count,
    zmq_endpoint,
    zmq_endpoint_or_none,
)
from shuttle.common.config import (
    DEFAULT_MODEL_DIR,
    LOG_LEVEL_ENV,
    SERVE_SECTIONS,
    CacheConfig,
    SchedulerConfig,
    WorkerConfig,
)
from shuttle.common.generation_config import AUTO
from shuttle.common.log_format import LOG_FORMAT_ENV, LOG_FORMATS
from shuttle.launcher.config_file import CONFIG_MODEL_FLAG, ConfigFileError, expand_config_file
from shuttle.launcher.vllm_flags import AlwaysOn, RefusingParser, add_vllm_flags

__all__ = ["TOOLS", "build_parser", "main", "parse_bytes"]

# Commands with a parser of their own (`shuttle NAME --help`), imported only when run (_run_tool): calibrate loads
# torch and a model, and `shuttle serve` needs none of them.
TOOLS = {
    "calibrate": "measure the model's steps on this machine and write a step-cost profile (for --step-cost-profile, "
                 "simulate and tune)",
    "simulate": "predict TTFT, ITL and throughput of a workload from a step-cost profile, without a model",
    "tune": "choose --max-num-batched-tokens and --max-num-seqs for latency objectives (simulated, then verified "
            "on real servers)",
    "bench": "benchmark a running server over streaming HTTP: TTFT, TPOT, ITL, throughput, goodput",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shuttle", description="LLM serving engine")
    from shuttle.common.version import shuttle_version
    parser.add_argument("--version", action="version", version=shuttle_version())
    commands = parser.add_subparsers(dest="command", required=True, parser_class=RefusingParser)
    serve = commands.add_parser("serve", help="start frontend, scheduler and worker on one model",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    default_model = str(DEFAULT_MODEL_DIR) if DEFAULT_MODEL_DIR.is_dir() else None
    serve.add_argument("model_dir", nargs="?", default=default_model, metavar="MODEL",
                       help="a Hugging Face model directory (config.json, safetensors, tokenizer.json) or a Hugging "
                            "Face id (org/name: the local cache first, else a download unless HF_HUB_OFFLINE=1)")
    _add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    for section in SERVE_SECTIONS:
        add_config_options(serve, section)
    serve.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE", type=chat_template,
                       help="Jinja chat template overriding the one in tokenizer_config.json: a file, or the "
                            "template itself (a value that is no file and holds {{ or {%%}, as vLLM takes it)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics and on "
                            "batch jobs (default: $SHUTTLE_API_KEY, else vLLM's $VLLM_API_KEY; prefer them or "
                            "--api-key-file: a command line is visible to every user of the machine)")
    serve.add_argument("--api-key-file", default=None, metavar="FILE",
                       help="read the API key from the first line of FILE")
    serve.add_argument("--allowed-origins", type=origins, default=None, metavar="ORIGINS",
                       help="comma-separated origins, or vLLM's JSON list of them (e.g. https://app.example or "
                            "'[\"https://app.example\"]'), whose browser pages may call the API "
                            "and open the WebSocket: CORS headers and preflight answers for them; '*' allows any "
                            "origin; None: no CORS headers, and WebSockets only from the server's own host")
    serve.add_argument("--batch-endpoint", default=None, type=zmq_endpoint_or_none,
                       help="ZeroMQ endpoint for batch clients (default: tcp://127.0.0.1:PORT+1, loopback even with "
                            "--host 0.0.0.0; with --uds PATH, ipc://PATH.batch beside the HTTP socket; 'none' "
                            "disables)")
    serve.add_argument("--zmq-transport", choices=["ipc", "tcp"], default="ipc",
                       help="ipc:// sockets in a private runtime directory, or tcp:// on loopback authenticated "
                            "with ZeroMQ CURVE keys made for each launch")
    serve.add_argument("--config", default=None, metavar="FILE.yaml",
                       help="flags from a YAML file: keys are long flag names (with - or _), values as on the command "
                            "line (true/false for a switch, a list for several values); flags on the command line "
                            "win over the file's")
    serve.add_argument("--log-level", default=None, type=str.lower, choices=LOG_LEVELS,
                       help=f"log level of every process (default: ${LOG_LEVEL_ENV}, else info)")
    serve.add_argument("--log-format", default=None, type=str.lower, choices=LOG_FORMATS,
                       help=f"every process's log lines as text, or one JSON object per line with time, level, "
                            f"process, group and (on a request's lines) request_id (default: ${LOG_FORMAT_ENV}, "
                            f"else text)")
    add_vllm_flags(serve)  # vLLM's flags taken where they name what shuttle does, else refused by name
    _add_engine_parser(commands, serve)
    serve.add_argument("-dp", "--data-parallel-size", type=count, default=1, metavar="M",
                       help="serving groups (each a scheduler + its worker, with its own KV cache) behind the one "
                            "frontend, which routes each request by prefix affinity and least load; 0 with only "
                            "--engine-endpoint groups")
    serve.add_argument("--engine-endpoint", action="append", default=None, metavar="ENDPOINT", type=zmq_endpoint,
                       help="a serving group started elsewhere with `shuttle engine --listen ENDPOINT` (repeatable); "
                            "it joins when it answers, and a dropped connection takes it out of routing until it "
                            "is back; tcp:// needs the engine host's CURVE keys in $SHUTTLE_CURVE_KEYS")
    _add_plan_parser(commands, default_model)
    commands.add_parser("curve-keys", help="print a new set of ZeroMQ CURVE keys for $SHUTTLE_CURVE_KEYS "
                                           "(the same on a frontend's host and its engines' hosts)")
    from shuttle.batch_jobs.batch_file import add_parser as add_batch_parser
    add_batch_parser(commands)
    for name, summary in TOOLS.items():  # listed in `shuttle --help`; main() hands their arguments over unparsed
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def _add_model_options(serve: argparse.ArgumentParser) -> None:
    """Where the model comes from and how it is served, under vLLM's flag names (ModelConfig's fields)."""
    serve.add_argument("--model", dest="model_option", default=None, metavar="MODEL", help="MODEL as a flag")
    # a --config file's `model` key (launcher/config_file.py): MODEL or --model on the command line wins over it
    serve.add_argument(CONFIG_MODEL_FLAG, dest="config_model", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--revision", default=None, help="branch, tag or commit of a Hugging Face id (none given: main)")
    serve.add_argument("--tokenizer", default=None, metavar="DIR_OR_ID",
                       help="tokenizer directory or Hugging Face id (default: MODEL's)")
    serve.add_argument("--download-dir", default=None, metavar="DIR",
                       help="Hugging Face cache to look in and download to (default: $HF_HOME/hub)")
    serve.add_argument("--trust-remote-code", action="store_true",
                       help="let transformers run a model's own Python code (config.json auto_map); without it "
                            "such a model is refused")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME", type=served_name,
                       help="the `model` names clients may use, the first reported in responses; None: MODEL as "
                            "typed")
    serve.add_argument("--dtype", default="auto", type=dtype_name, choices=["auto", "float32", "bfloat16", "float16"],
                       metavar="{auto,float32,float,bfloat16,float16,half}",
                       help="weights and KV cache dtype; auto: bfloat16 on CUDA, and on a CPU with amx_bf16 or "
                            "avx512_bf16 (else float32); the start-up line says which and why")
    serve.add_argument("--max-model-len", type=token_count, default=None,
                       help="default: the model's position limit; 32k = 32000, 32K = 32768 (vLLM's suffixes)")
    serve.add_argument("--hf-overrides", type=json_object, default=None, metavar="JSON",
                       help="a JSON object merged into the model's config.json, as vLLM does, for every process (e.g. "
                            "'{\"max_position_embeddings\": 256}' also lowers the --max-model-len default): a nested "
                            "configuration (text_config) takes its keys, any other key is replaced")
    serve.add_argument("--seed", type=seed, default=0,
                       help="seeds the worker's generator, which samples the requests that give no `seed` (a "
                            "request's own seed is reproducible in any batch; these only for the same arrivals)")
    serve.add_argument("--max-logprobs", type=logprobs_cap, default=20,
                       help="most `logprobs` / `top_logprobs` alternatives a request may ask for per token (-1: no "
                            "cap but the vocabulary's size)")
    serve.add_argument("--generation-config", default=AUTO, metavar="auto|vllm|FOLDER",
                       help="where the defaults of the request fields temperature, top_p, top_k, min_p, "
                            "repetition_penalty and max_tokens (max_new_tokens) come from: auto, the model's "
                            "generation_config.json; vllm, none (the neutral defaults); or FOLDER's "
                            "generation_config.json. A request that sets a field keeps its value")
    serve.add_argument("--enable-chunked-prefill", action=AlwaysOn, default=True,
                       why="shuttle always prefills long prompts in chunks within --max-num-batched-tokens (set it "
                           "to the longest prompt to prefill each in one step)",
                       help="always on: long prompts are prefilled in chunks (--no-enable-chunked-prefill is refused)")
    # default=False: a store_false action's own default (True) would otherwise become the shared dest's default
    serve.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false", default=False,
                       help="vLLM's older spelling: no request log line (the default)")


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand `command`'s own parser."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def _run_tool(name: str, argv: list[str]) -> int:
    """Run TOOLS[name] on its own arguments."""
    if name == "calibrate":
        from shuttle.capacity.calibrate import main
    elif name == "simulate":
        from shuttle.capacity.simulate import main
    elif name == "tune":
        from shuttle.capacity.tune import main
    else:
        from shuttle.capacity.bench_serve import main
    return main(argv)


def _add_engine_parser(commands, serve: argparse.ArgumentParser) -> None:
    """`shuttle engine`: every `serve` option that shapes a serving group, plus where it listens."""
    engine = commands.add_parser("engine", parents=[serve], conflict_handler="resolve",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 help="run one serving group (scheduler + worker) for a frontend on another host")
    engine.add_argument("--listen", required=True, metavar="ENDPOINT", type=zmq_endpoint,
                        help="where the scheduler listens for frontends, e.g. tcp://10.0.0.3:7100 (tcp:// needs "
                             "$SHUTTLE_CURVE_KEYS, the same as on the frontend's host); frontends name it with "
                             "`shuttle serve --engine-endpoint ENDPOINT`")


def _add_plan_parser(commands, default_model: str | None) -> None:
    """`shuttle plan`: the memory plan and the concurrency table, measured without starting a server."""
    plan = commands.add_parser("plan", help="memory plan and how many requests fit (never starts the server)",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    plan.add_argument("model_dir", nargs="?", default=default_model, metavar="MODEL_DIR")
    plan.add_argument("--max-model-len", type=positive, default=None, help="default: the model's position limit")
    plan.add_argument("--dtype", default="auto", type=dtype_name, choices=["auto", "float32", "bfloat16", "float16"],
                      metavar="{auto,float32,float,bfloat16,float16,half}",
                      help="as shuttle serve resolves it here (auto: bfloat16 on CUDA, and on a CPU with amx_bf16 or "
                           "avx512_bf16, else float32); with --device, auto is bfloat16")
    budget = plan.add_mutually_exclusive_group()
    add_config_options(budget, CacheConfig, ["kv_cache_memory", "num_kv_blocks", "gpu_memory_utilization"],
                       kv_cache_memory={"default": None, "help": f"bytes for the KV cache (default "
                                                                 f"{CacheConfig().kv_cache_memory // 2**30}GiB, as "
                                                                 f"shuttle serve)"},
                       gpu_memory_utilization={"default": None, "help": "share of a CUDA device's memory for "
                                                                        "weights, activations and KV (CUDA only)"})
    add_config_options(plan, CacheConfig, ["block_size"])
    add_config_options(plan, SchedulerConfig, ["max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"])
    add_config_options(plan, WorkerConfig, ["attention_backend", "quantization"])
    plan.add_argument("--no-measure-processes", action="store_true",
                      help="skip measuring the frontend and scheduler processes (two short subprocesses)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--device", default=None, help="plan for a device that is not present, from its datasheet "
                      "(h100, h200, a100, l40s, l4, a10; capacity/hardware.py): nothing is measured")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        return _run_tool(argv[0], argv[1:])
    parser = build_parser()
    if argv and argv[0] in ("serve", "engine"):
        try:
            argv = expand_config_file(argv, _command_parser(parser, argv[0]))
        except ConfigFileError as exc:
            print(f"shuttle {argv[0]}: error: {exc}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    if args.command in ("serve", "engine"):
        level = args.log_level or os.environ.get(LOG_LEVEL_ENV, "info").lower()
        if level not in LOG_LEVELS:
            print(f"shuttle: error: ${LOG_LEVEL_ENV} {level!r} is not one of {', '.join(LOG_LEVELS)}", file=sys.stderr)
            return 2
        os.environ[LOG_LEVEL_ENV] = level.upper()  # every child process reads it (common/process.py)
        log_format = args.log_format or os.environ.get(LOG_FORMAT_ENV, "").lower() or "text"  # empty: unset
        if log_format not in LOG_FORMATS:
            print(f"shuttle: error: ${LOG_FORMAT_ENV} {log_format!r} is not one of {', '.join(LOG_FORMATS)}",
                  file=sys.stderr)
            return 2
        os.environ[LOG_FORMAT_ENV] = log_format  # likewise (common/log_format.py)
        if log_format == "json":  # progress bars (transformers' weight loading) are no JSON lines
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        from shuttle.common.errors import ModelDirError
        from shuttle.launcher.model_args import resolve_model_args
        try:
            resolve_model_args(args)  # MODEL (a directory or a Hugging Face id) made a local directory, checked
        except ModelDirError as exc:
            print(f"shuttle: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        from shuttle.launcher.commands import serve
        return serve(args)
    if args.command == "engine":
        from shuttle.launcher.commands import engine
        return engine(args)
    if args.command == "curve-keys":
        from shuttle.common.ipc import CurveKeys
        print(CurveKeys.generate().to_env())
        return 0
    if args.command == "plan":
        if args.device:  # a device that is not here: its datasheet, nothing measured
            from shuttle.capacity.device_plan import main as plan
        else:
            from shuttle.capacity.memory_plan import main as plan
        return plan(args)
    if args.command == "batch":
        from shuttle.batch_jobs.batch_file import run as batch
        return batch(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
