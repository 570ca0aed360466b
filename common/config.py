"""Frozen configuration shared by the launcher and every process.

The launcher resolves everything that needs a look at the model directory (max_model_len, end-of-sequence
ids) once, then hands the same `ShuttleConfig` to each child as JSON, so no two processes can disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path

import msgspec

from shuttle.common.api_config import ApiConfig, ToolCallConfig, tool_call_error
from shuttle.common.arg_types import count, option, parse_bytes, positive, seconds, unit_fraction
from shuttle.common.cpu_threads import cpu_list
from shuttle.common.devices import parse_device
from shuttle.common.errors import ModelDirError
from shuttle.common.generation_config import AUTO
from shuttle.common.lora import LoRAConfig, checked_lora_config, lora_config_error
from shuttle.common.model_config import ModelConfig
from shuttle.common.speculative import SpeculativeConfig, checked_draft_model, parse_speculative_config

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"


def _batch_endpoint(args: argparse.Namespace) -> str:
    """--batch-endpoint, else tcp://127.0.0.1:(PORT + 1) (any free port when --port is 0), or with --uds PATH
    ipc://PATH.batch beside the HTTP socket (two --uds servers on one host must not collide on PORT+1); "none"
    disables it.

    Loopback even with --host 0.0.0.0: batch jobs run unmetered work, so exposing them is a separate decision.
    """
    if args.batch_endpoint:
        return "" if args.batch_endpoint == "none" else args.batch_endpoint
    if getattr(args, "uds", None):
        return f"ipc://{Path(args.uds).absolute()}.batch"
    return f"tcp://127.0.0.1:{args.port + 1 if args.port else '*'}"


def _model_config(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig of `shuttle serve` arguments whose model_dir (and tokenizer_dir) the launcher has resolved
    to local directories (common/model_source.py); `model` is MODEL as typed, the default served id."""
    typed = getattr(args, "model", None) or args.model_dir
    names = tuple(getattr(args, "served_model_name", None) or ()) or (typed,)
    tokenizer_dir = getattr(args, "tokenizer_dir", None)
    return ModelConfig.from_dir(args.model_dir, args.max_model_len, names[0], args.dtype,
                                tokenizer_dir=str(Path(tokenizer_dir).resolve()) if tokenizer_dir else "",
                                served_model_aliases=names[1:], seed=getattr(args, "seed", 0),
                                max_logprobs=getattr(args, "max_logprobs", 20),
                                trust_remote_code=getattr(args, "trust_remote_code", False),
                                generation_config=getattr(args, "generation_config", AUTO),
                                hf_overrides=getattr(args, "hf_overrides", None), model_as_given=str(typed))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape. Each field's help says what it means."""

    block_size: int = option(16, "tokens per KV block", type=positive)
    num_kv_blocks: int | None = option(None, "fixed number of KV blocks (overrides --kv-cache-memory)", type=positive)
    kv_cache_memory: int = option(1 << 30, "on the CPU: bytes the worker may spend on K and V of all layers, e.g. "
                                           "512MiB (on CUDA --gpu-memory-utilization sizes the cache)",
                                  type=parse_bytes)
    gpu_memory_utilization: float = option(
        0.9, "on CUDA: share of each device's memory for weights, activations and KV; the KV cache gets what the "
             "weights, one profiling step at the largest step shape and a CUDA-graph allowance leave "
             "(worker/kv_sizing.py; --num-kv-blocks overrides it)", type=unit_fraction)
    enable_prefix_caching: bool = option(True, "share full KV blocks of identical prompt prefixes between requests")
    kv_cache_dtype: str = option("auto", "dtype K and V are stored in: auto (the model's --dtype), float32 or bfloat16 "
                                         "(a float32 model with a bfloat16 cache holds twice the tokens; attention "
                                         "still accumulates in float32)", choices=["auto", "float32", "bfloat16"])


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets and policies of the scheduler. Each field's help says what it means."""

    max_num_seqs: int = option(128, "most sequences in one step", type=positive)
    max_num_batched_tokens: int = option(2048, "most tokens (prefill chunks + decodes) in one step; longer prompts "
                                               "are prefilled in chunks", type=positive)
    max_waiting_requests: int = option(4096, "bound of the waiting queue: past it new requests get HTTP 503",
                                       type=positive)
    scheduling_policy: str = option("fcfs", "fcfs: arrival order; priority: the request field `priority`, lower "
                                            "first, with aging", choices=["fcfs", "priority"])
    priority_aging_seconds: float = option(10.0, "under --scheduling-policy priority: seconds of waiting worth one "
                                                 "priority level (0 turns aging off)", type=seconds)
    request_timeout: float = option(0.0, "seconds from arrival after which an unfinished request ends with an error "
                                         "(0: never; a request's own `timeout` field can ask for less)", type=seconds)
    async_scheduling: bool = option(True, "plan the next step while the worker runs the current one (two steps in "
                                          "flight); --no-async-scheduling plans, waits and settles one at a time")
    max_seqs_per_request: int = option(0, "running sequences one client request (its prompts x n) may hold; 0: a fair "
                                          "share (max_num_seqs / live requests; all but an eighth when alone)",
                                       type=count)
    long_prefill_token_threshold: int | None = option(
        None, "while others wait, one request's prefill chunk takes at most this many tokens of a step, so short "
              "prompts get their first token while a long one is chunked (vLLM's name; None: a quarter of "
              "--max-num-batched-tokens; 0: no cap)", type=count)
    ttft_slo_ms: float = option(0.0, "TTFT objective (ms): a request predicted to miss it is refused at once with 503 "
                                     "and Retry-After (scheduler/admission.py; 0: off; a request's `ttft_slo_ms` field "
                                     "sets its own)", type=float)
    step_cost_profile: str = option("", "calibrated step-cost profile (`shuttle calibrate`) for --ttft-slo-ms; "
                                        "without one the cost model is fitted online to the server's own steps",
                                    metavar="JSON")
    step_log: str = option("", "append every step's shape, served seconds and end time to this file as JSON lines "
                               "(scheduler/step_log.py), to set the served steps against a `shuttle calibrate` profile",
                           metavar="FILE")
    batch_background: bool = option(True, "run batch jobs (the ZeroMQ endpoint) behind every interactive HTTP or "
                                          "WebSocket request under either --scheduling-policy, so a running batch job "
                                          "does not raise interactive TTFT; --no-batch-background schedules them "
                                          "like interactive requests")
    speculative_config: SpeculativeConfig | None = option(
        None, "speculative decoding, as vLLM's JSON: n-gram {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
              "\"prompt_lookup_max\": n, \"prompt_lookup_min\": m} or a draft model {\"method\": \"draft_model\", "
              "\"model\": DIR, \"num_speculative_tokens\": k}; each decoding sequence verifies up to k drafts per "
              "step (docs/scheduling.md); steps are then not overlapped", type=parse_speculative_config,
        metavar="JSON")


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker executes steps. Each field's help says what it means."""

    device: str = option("auto", "auto: cuda when torch sees a CUDA device, else cpu; cpu; cuda or cuda:N: the first "
                                 "device, each worker rank of each serving group owning one, rank r of group g on "
                                 "cuda:(N + g x tensor_parallel_size + r)", type=parse_device,
                         metavar="auto|cpu|cuda[:N]")
    attention_backend: str = option("auto", "auto: flex on CUDA, cpu on a CPU; cpu: numba paged decode kernel + "
                                            "per-sequence prefill; reference: one sequence at a time with torch "
                                            "SDPA; flex: torch FlexAttention over the paged cache (compiled on CUDA, "
                                            "eager on a CPU)",
                                    choices=["auto", "cpu", "reference", "flex"])
    worker_threads: int = option(0, "intra-op CPU threads of each worker (0: one per core it may use; "
                                    "docs/operations.md, threads and cores)", type=count)
    worker_cores: str = option("", "CPU list (like 0-3,6) the workers are pinned to, split between them; the "
                                   "frontend and scheduler go to the other allowed cores ('': no pinning)",
                               type=cpu_list, metavar="LIST")
    enforce_eager: bool = option(False, "run every step eagerly: no CUDA graphs for decode-only steps on CUDA "
                                        "(with the flex attention backend) and no compiled decode forward on a CPU "
                                        "(with the cpu backend)")
    quantization: str = option("none", "int8: the decoder layers' linear layers (not the embeddings or lm_head) get "
                                       "per-output-channel int8 weights at load, run by torch's int8 weight-only "
                                       "CPU matmul (worker/quantization.py; CPU only, without tensor parallel; "
                                       "output close to, not equal to, the unquantized model's); none: the "
                                       "checkpoint's weights", metavar="{none,int8}")


@dataclass(frozen=True)
class ParallelConfig:
    """How one serving group spreads its model over devices (tensor parallel: worker/parallel.py). Each field's help
    says what it means."""

    tensor_parallel_size: int = option(1, "worker ranks (one process per device) that split the model's attention "
                                          "heads, KV heads and MLP columns between them (torch.distributed: gloo on "
                                          "CPU, NCCL on CUDA); the heads must divide by it", type=positive,
                                          aliases=("-tp",))
    master_addr: str = option("127.0.0.1", "host of tensor-parallel rank 0's torch.distributed rendezvous")
    master_port: int = option(0, "port of that rendezvous (0: a free loopback port at each engine start)", type=count)
    distributed_executor_backend: str = option(
        "mp", "where the serving groups' worker ranks run: mp, processes of this launcher on this machine; ray, Ray "
              "actors on the nodes of a Ray cluster, one placement group per serving group (needs pip install "
              "'shuttle[ray]'; docs/scaling.md)", choices=["mp", "ray"])
    ray_address: str = option("", "the Ray cluster to join under --distributed-executor-backend ray (default: "
                                  "$RAY_ADDRESS, else a Ray instance on this machine)", metavar="HOST:PORT")
    ray_placement_strategy: str = option("STRICT_PACK", "how Ray places a serving group's ranks: STRICT_PACK (one "
                                                        "node), PACK, SPREAD or STRICT_SPREAD (every rank on its own "
                                                        "node)", choices=["STRICT_PACK", "PACK", "SPREAD",
                                                                          "STRICT_SPREAD"])


LOG_LEVEL_ENV = "SHUTTLE_LOG_LEVEL"  # every process's log level (`shuttle serve --log-level` sets it)
TP_RANK_ENV = "SHUTTLE_TP_RANK"  # a worker process's tensor-parallel rank, set by the launcher (unset: 0)
MODEL_SOURCE_ENV = "SHUTTLE_MODEL_SOURCE"  # "org/name@commit" of MODEL for a Ray rank to fetch (worker/model_fetch.py)
DEVICE_ENV = "SHUTTLE_DEVICE"  # a worker's own device, where the launcher names it (a Ray rank: its one GPU is cuda:0)
DP_GROUP_ENV = "SHUTTLE_DP_GROUP"  # an engine process's local serving group (data parallel), set likewise (unset: 0)


def tensor_parallel_error(hf_config: dict, tensor_parallel_size: int) -> str | None:
    """Why `tensor_parallel_size` ranks cannot split this model's heads evenly (None when they can).

    Args:
        hf_config: the model's config.json (its text_config is read when present).
    """
    if tensor_parallel_size == 1:
        return None
    config = hf_config.get("text_config") or hf_config
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return "config.json names no num_attention_heads, so its heads cannot be split between ranks"
    for name, number in (("attention heads", heads), ("KV heads", kv_heads)):
        if number % tensor_parallel_size:
            return (f"--tensor-parallel-size {tensor_parallel_size} does not divide the model's {number} {name} "
                    f"(each rank must hold the same number of whole heads)")
    return None


@dataclass(frozen=True)
class OpsConfig:
    """Supervision, shutdown and connection limits. Each field's help says what it means."""

    step_timeout: float = option(60.0, "seconds a step of the worker may go without progress (its process "
                                       "using no CPU time) before the scheduler declares the worker hung and the "
                                       "engine restarts; a slow but working step may take 10 times as long "
                                       "(0: never)", type=seconds)
    heartbeat_timeout: float = option(30.0, "seconds without a heartbeat after which the launcher declares a "
                                            "process hung and restarts it, and a frontend declares a remote serving "
                                            "group (--engine-endpoint) lost (0: never)", type=seconds)
    max_restarts: int = option(5, "restarts in a row of the engine (scheduler + worker) or of the frontend before "
                                  "the launcher gives up and exits 1 (0: exit at the first failure; a unit that "
                                  "then serves 60 s starts counting afresh)", type=count)
    shutdown_timeout: float = option(30.0, "on SIGTERM, seconds in-flight requests may take to finish before they "
                                           "end with an error", type=seconds)
    keep_alive_timeout: float = option(15.0, "seconds an idle HTTP connection is kept open", type=seconds)
    header_timeout: float = option(10.0, "seconds a client has to finish sending a request head it has started",
                                   type=seconds)
    body_timeout: float = option(30.0, "seconds a client has to send the request body after its head (else HTTP "
                                       "408)", type=seconds)
    max_batch_message_bytes: int = option(4 * 2**20, "largest frame a client may send to the ZeroMQ batch "
                                                     "endpoint, e.g. 16MiB (default: the HTTP body limit); a client "
                                                     "that sends a larger one loses its connection before the frame "
                                                     "is buffered (0: no limit)", type=parse_bytes)


@dataclass(frozen=True)
class ObservabilityConfig:
    """What the processes log. Each field's help says what it means."""

    enable_log_requests: bool = option(False, "log one line per sequence as the frontend submits it (its id, prompt "
                                              "tokens, sampling parameters and serving group; never the prompt text "
                                              "or the API key) and one when it ends (its finish reason and output "
                                              "tokens); --disable-log-requests is vLLM's older spelling of the "
                                              "default")
    disable_log_stats: bool = option(False, "stop the scheduler's periodic throughput / queue / KV cache log line")
    otlp_traces_endpoint: str = option("", "export one OpenTelemetry span per request (vLLM's llm_request, with its "
                                           "attribute names) to this OTLP collector; the protocol is "
                                           "$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc, the default, or "
                                           "http/protobuf); needs pip install 'shuttle[otel]'", metavar="URL")


# whose fields are `shuttle serve` flags
SERVE_SECTIONS = (SchedulerConfig, CacheConfig, WorkerConfig, OpsConfig, ParallelConfig, ObservabilityConfig,
                  ToolCallConfig, ApiConfig, LoRAConfig)


def section_from_args(cls, args: argparse.Namespace):
    """Build a config section from parsed flags named after its fields."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class IpcConfig:
    """ZeroMQ endpoints. ipc:// paths live in a private 0700 runtime directory made by the launcher.

    Attributes:
        requests: scheduler ROUTER that frontends' DEALERs connect to (Submit/Abort in, outputs back).
        plans: scheduler PUSH -> worker PULL, one StepPlan per step.
        results: worker PUSH -> scheduler PULL, one StepResult per step plus start-up reports.
        control: launcher PULL that every child reports readiness and heartbeats to.
        supervisor: frontend PULL that the launcher tells engine failures to (ipc, in the runtime directory).
        rank_plans: plan endpoints of tensor-parallel ranks 1..N-1 (rank 0 uses `plans`): the scheduler PUSHes
            every StepPlan to each rank's own socket, so no rank can miss one.
        curve: with tcp transport, the sockets above that cross tcp use ZeroMQ CURVE; the per-launch keys
            travel in the environment (SHUTTLE_CURVE_KEYS), never on a command line.
        group_requests: the frontend's view of data parallelism: the `requests` endpoint of every serving group
            the launcher runs (group i at index i); empty: the one group at `requests`.
        remote_groups: `requests` endpoints of serving groups started elsewhere (`shuttle engine --listen`), which
            the frontend connects to and watches itself; they follow the local groups in the router's numbering.
    """

    requests: str
    plans: str
    results: str
    control: str
    supervisor: str = ""
    curve: bool = False
    group_requests: tuple[str, ...] = ()
    remote_groups: tuple[str, ...] = ()
    rank_plans: tuple[str, ...] = ()

    @staticmethod
    def in_directory(runtime_dir: str, group: int = 0, tensor_parallel_size: int = 1) -> "IpcConfig":
        """Endpoints in `runtime_dir`; serving group `group` > 0 gets its own requests/plans/results sockets, and
        each worker rank r > 0 its own plans socket."""
        suffix = f"-{group}" if group else ""

        def endpoint(name: str) -> str:
            return f"ipc://{runtime_dir}/{name}.sock"

        return IpcConfig(requests=endpoint(f"requests{suffix}"), plans=endpoint(f"plans{suffix}"),
                         results=endpoint(f"results{suffix}"), control=endpoint("control"),
                         supervisor=endpoint("supervisor"),
                         rank_plans=tuple(endpoint(f"plans{suffix}-rank{r}") for r in range(1, tensor_parallel_size)))

    @property
    def all_groups(self) -> tuple[str, ...]:
        """The requests endpoint of every serving group the frontend routes to: local ones, then remote ones."""
        return (self.group_requests or ((self.requests,) if self.requests else ())) + self.remote_groups

    def plans_of(self, rank: int) -> str:
        """The endpoint worker rank `rank` receives its StepPlans on."""
        return self.plans if rank == 0 else self.rank_plans[rank - 1]

    @property
    def all_plans(self) -> list[str]:
        return [self.plans, *self.rank_plans]


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
    chat_template: str | None = None  # Jinja file overriding the tokenizer's chat template
    batch_endpoint: str = ""  # ZeroMQ endpoint for batch clients ("" = none)
    # Origins whose browser pages may call the API (CORS) and open the WebSocket; "*" is any origin; empty: no CORS
    # headers at all, and WebSockets only from the server's own host.
    allowed_origins: tuple[str, ...] = ()
    ops: OpsConfig = field(default_factory=OpsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    tool_calls: ToolCallConfig = field(default_factory=ToolCallConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @staticmethod
    def from_args(args: argparse.Namespace, ipc: IpcConfig) -> "ShuttleConfig":
        """Build from `shuttle serve` arguments (see launcher/cli.py). Raises ModelDirError."""
        model = _model_config(args)
        tp = args.tensor_parallel_size
        refusal = tensor_parallel_error(model.hf_config(), tp)
        if refusal:  # refused before any process starts, not after every rank has loaded the model
            raise ModelDirError(refusal)
        tool_calls = section_from_args(ToolCallConfig, args)
        refusal = tool_call_error(tool_calls)
        if refusal:
            raise ModelDirError(refusal)
        lora = section_from_args(LoRAConfig, args)
        refusal = lora_config_error(lora, tp)
        if refusal:
            raise ModelDirError(refusal)
        lora = checked_lora_config(lora, model.served_model_names)
        scheduler = section_from_args(SchedulerConfig, args)
        if scheduler.speculative_config is not None:
            scheduler = dataclasses.replace(scheduler, speculative_config=checked_draft_model(
                scheduler.speculative_config, model.hf_config()))
        if ipc is not None and len(ipc.rank_plans) != tp - 1:
            raise ValueError(f"{tp} tensor-parallel ranks need {tp - 1} rank plan endpoints, got {len(ipc.rank_plans)}")
        return ShuttleConfig(
            model=model,
            ipc=ipc,
            cache=section_from_args(CacheConfig, args),
            scheduler=scheduler,
            worker=section_from_args(WorkerConfig, args),
            host=args.host,
            port=args.port,
            chat_template=args.chat_template,
            batch_endpoint=_batch_endpoint(args),
            allowed_origins=tuple(args.allowed_origins or ()),
            ops=section_from_args(OpsConfig, args),
            parallel=section_from_args(ParallelConfig, args),
            observability=section_from_args(ObservabilityConfig, args),
            tool_calls=tool_calls,
            api=section_from_args(ApiConfig, args),
            lora=lora,
        )

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @staticmethod
    def from_json(text: str) -> "ShuttleConfig":
        return msgspec.json.decode(text, type=ShuttleConfig)
