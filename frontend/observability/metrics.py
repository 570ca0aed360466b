"""Prometheus metrics of what clients feel, named like vLLM's under the `shuttle:` prefix (`--metric-prefix vllm`:
under vLLM's own, `vllm:`, so its dashboards, alerts and autoscalers read them unchanged).

Request-level latencies and per-request sizes are measured here, in the frontend, where the client's experience
is. Scheduler figures (queue lengths, KV usage, prefix cache, preemptions) come from the scheduler's periodic
stats messages and are read at scrape time; the frontend never waits for them.

As vLLM does, every `shuttle:` series carries `model_name` (the first --served-model-name), so dashboards written
for vLLM's series filter the same way. The series are kept unlabelled by model inside (the dashboard feed reads
them as they are) and get the label, and the prefix --metric-prefix names, on the way out, in one collector; the
process and GC collectors of prometheus-client stand beside them, unlabelled, as in any Python exporter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shuttle.common.config import ShuttleConfig
from shuttle.common.errors import InvalidRequestError
from shuttle.common.messages import RequestOutput, SchedulerInfo, SchedulerStats, Submit
from shuttle.frontend.observability.tracing import TRACE_HEADERS, RequestTracer

# Latency buckets in seconds (vLLM's choices, extended up for CPU serving).
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# The n request parameter: vLLM's buckets (vllm/v1/metrics/loggers.py, vllm:request_params_n).
_N = (1, 2, 5, 10, 20)
_OWN_PREFIX = "shuttle:"  # every series' name inside; --metric-prefix renames it on the way out
_UNKNOWN_MAX_MODEL_LEN = 8192  # token-count buckets of a Metrics built without a config (unit tests)


def one_two_five(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's bucket boundaries for per-request token counts
    (build_1_2_5_buckets(max_model_len) in vllm/v1/metrics/loggers.py)."""
    bounds: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


class _Exported:
    """Re-exports every family of `inner` with model_name="<name>" added to each sample's labels and, when `prefix`
    is not "shuttle", its `shuttle:` prefix replaced by `prefix:` (family and sample names alike)."""

    def __init__(self, inner: CollectorRegistry, model_name: str, prefix: str = "shuttle"):
        self._inner = inner
        self._model_name = model_name
        self._prefix = f"{prefix}:"

    def _name(self, name: str) -> str:
        return self._prefix + name[len(_OWN_PREFIX):] if name.startswith(_OWN_PREFIX) else name

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            labelled = Metric(self._name(family.name), family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(name=self._name(sample.name),
                                                labels={"model_name": self._model_name, **sample.labels})
                                for sample in family.samples]
            yield labelled


class _CacheConfigCollector:
    """vllm:cache_config_info's counterpart: a gauge of 1 whose labels are the KV cache's configuration."""

    def __init__(self, config: ShuttleConfig, info_source: Callable[[], SchedulerInfo | None]):
        self._config = config
        self._info = info_source

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("shuttle:cache_config_info", "Information of the KV cache configuration.",
                                   labels=["block_size", "num_gpu_blocks", "num_gpu_blocks_override", "cache_dtype",
                                           "enable_prefix_caching", "gpu_memory_utilization"])
        info = self._info()
        if info is not None:  # the scheduler's answer to Hello: known before the frontend serves
            cache = self._config.cache
            # label values as vLLM writes them: str() of each setting (None, True, 0.9)
            family.add_metric([str(info.block_size), str(info.num_kv_blocks), str(cache.num_kv_blocks),
                               self._config.model.dtype, str(cache.enable_prefix_caching),
                               str(cache.gpu_memory_utilization)], 1.0)
        yield family


class _SchedulerCollector:
    """Exposes the latest SchedulerStats snapshot as gauges and counters."""

    def __init__(self, stats_source, max_loras: int | None = None):
        self._stats = stats_source
        self._max_loras = max_loras  # --max-loras under --enable-lora, else None: no lora_requests_info

    def collect(self) -> Iterator[Metric]:
        stats: SchedulerStats = self._stats()
        gauges = {"num_requests_running": ("Requests in the running set.", stats.num_running),
                  "num_requests_waiting": ("Requests in the waiting queue.", stats.num_waiting),
                  "kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full).",
                                          stats.num_blocks_in_use / max(stats.num_total_blocks, 1))}
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"shuttle:{name}", doc, value=value)
        counters = {"prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                             stats.prefix_cache_queries),
                    "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
                    "num_preemptions": ("Requests preempted (recomputed later).", stats.num_preemptions),
                    "spec_decode_num_drafts": ("Sequence-steps that verified drafts (n-gram or draft model).",
                                               stats.spec_num_drafts),
                    "spec_decode_num_draft_tokens": ("Draft tokens verified.", stats.spec_num_draft_tokens),
                    "spec_decode_num_accepted_tokens": ("Draft tokens accepted.", stats.spec_num_accepted_tokens)}
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"shuttle:{name}", doc, value=value)
        per_pos = CounterMetricFamily("shuttle:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position among a step's drafts (0: the first).",
                                      labels=["position"])
        for position, value in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric([str(position)], value)
        yield per_pos
        if self._max_loras is not None:  # vLLM's: the value is the time of the snapshot, the facts are labels
            info = GaugeMetricFamily("shuttle:lora_requests_info", "LoRA adapters of running and waiting requests.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(self._max_loras), ",".join(sorted(set(stats.lora_running))),
                             ",".join(sorted(set(stats.lora_waiting)))], time.time())
            yield info


class _GroupCollector:
    """Per serving group (data parallelism), labelled group="i": up, queues, KV usage, failures, routed."""

    def __init__(self, groups_source):
        self._groups = groups_source

    def collect(self) -> Iterator[Metric]:
        groups = self._groups()
        families = {
            "group_up": (GaugeMetricFamily, "1 while the serving group takes new requests, else 0.",
                         lambda g: float(g.up)),
            "group_num_requests_running": (GaugeMetricFamily, "Requests in the group's running set.",
                                           lambda g: g.stats.num_running),
            "group_num_requests_waiting": (GaugeMetricFamily, "Requests in the group's waiting queue.",
                                           lambda g: g.stats.num_waiting),
            "group_kv_cache_usage_perc": (GaugeMetricFamily, "Fraction of the group's KV blocks in use.",
                                          lambda g: g.stats.num_blocks_in_use / max(g.stats.num_total_blocks, 1)),
            "group_failures": (CounterMetricFamily, "Times the group went down (died, hung, or lost).",
                               lambda g: g.times_down),
            "group_routed_requests": (CounterMetricFamily, "Sequences the router sent to the group.",
                                      lambda g: g.routed),
        }
        for name, (kind, doc, value) in families.items():
            family = kind(f"shuttle:{name}", doc, labels=["group"])
            for group in groups:
                family.add_metric([str(group.group)], value(group))
            yield family


class Metrics:
    """The frontend's registry. `request()` starts the per-request recorder used by TextGeneration.

    Args:
        stats_source: () -> the schedulers' SchedulerStats (summed over serving groups).
        groups_source: () -> list of frontend.engine_api.GroupState, for the per-group metrics (None: none).
        config: the server's configuration: the model_name label, the prefix (--metric-prefix), max_model_len
            (the token-count buckets) and the cache settings of shuttle:cache_config_info. None (bare registries in
            unit tests): no model_name label, the shuttle: prefix, no cache_config_info.
        info_source: () -> the scheduler's SchedulerInfo (None until one answered), for cache_config_info.
    """

    def __init__(self, stats_source, groups_source=None, config: ShuttleConfig | None = None,
                 info_source: Callable[[], SchedulerInfo | None] | None = None):
        self.registry = CollectorRegistry()  # what /metrics exposes
        self.tracer: RequestTracer | None = None  # --otlp-traces-endpoint: each sequence's span at its end
        r = self.series = CollectorRegistry()  # every shuttle: series, before the model_name label
        tokens = one_two_five(config.model.max_model_len if config else _UNKNOWN_MAX_MODEL_LEN)
        self.ttft = Histogram("shuttle:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("shuttle:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_LATENCY, registry=r)
        self.tpot = Histogram("shuttle:request_time_per_output_token_seconds",
                              "Per request: (finish - first token) / (output tokens - 1).", buckets=_LATENCY,
                              registry=r)
        self.e2e = Histogram("shuttle:e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY,
                             registry=r)
        self.queue = Histogram("shuttle:request_queue_time_seconds", "Arrival to first scheduled.", buckets=_LATENCY,
                               registry=r)
        self.prefill = Histogram("shuttle:request_prefill_time_seconds", "First scheduled to first token.",
                                 buckets=_LATENCY, registry=r)
        self.decode = Histogram("shuttle:request_decode_time_seconds", "First token to last token.", buckets=_LATENCY,
                                registry=r)
        # vLLM buckets this one (and e2e, queue, prefill, decode) from 0.3 s up; ours keep _LATENCY like its siblings
        self.inference = Histogram("shuttle:request_inference_time_seconds", "First scheduled to last token (time "
                                   "spent running).", buckets=_LATENCY, registry=r)
        self.request_prompt_tokens = Histogram("shuttle:request_prompt_tokens", "Prompt tokens per request.",
                                               buckets=tokens, registry=r)
        self.request_generation_tokens = Histogram("shuttle:request_generation_tokens",
                                                   "Generated tokens per request.", buckets=tokens, registry=r)
        self.params_max_tokens = Histogram("shuttle:request_params_max_tokens", "The max_tokens of each request (as "
                                           "applied: the default fills the context).", buckets=tokens, registry=r)
        self.params_n = Histogram("shuttle:request_params_n", "The n request parameter, once per prompt.",
                                  buckets=_N, registry=r)
        # vLLM's name; what it observes is the most tokens any of a prompt's n sequences generated
        self.max_generation_tokens = Histogram("shuttle:request_max_num_generation_tokens", "Per prompt, the most "
                                               "tokens any of its n sequences generated.", buckets=tokens, registry=r)
        self.prompt_tokens = Counter("shuttle:prompt_tokens", "Prompt tokens of requests that were prefilled.",
                                     registry=r)
        self.generation_tokens = Counter("shuttle:generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("shuttle:request_success", "Finished requests by finish_reason.",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("shuttle:request_rejected", "Requests refused: queue full (503), TTFT objective "
                                "out of reach (slo, 503), never fits or invalid (400).", ["reason"], registry=r)
        self.batch_malformed = Counter("shuttle:batch_malformed_messages", "Messages to the batch endpoint that were "
                                       "not one well-formed message, refused with 400: frames (not one payload "
                                       "frame), depth (nested too deep), decode (bad msgpack or types).", ["reason"],
                                       registry=r)
        self.step_batch = Histogram("shuttle:iteration_batch_size", "Sequences scheduled per step.", buckets=_COUNTS,
                                    registry=r)
        self.step_tokens = Histogram("shuttle:iteration_tokens_total", "Tokens scheduled per step.", buckets=_COUNTS,
                                     registry=r)
        # every label value known in advance starts at 0, as vLLM does for finished_reason: a rate panel then
        # shows 0 instead of no data (and a series that exists for the dashboard's checks)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(reason)
        for reason in ("queue_full", "slo", "never_fits", "invalid"):
            self.rejected.labels(reason)
        for reason in ("frames", "depth", "decode"):
            self.batch_malformed.labels(reason)
        lora = config.lora if config is not None else None
        r.register(_SchedulerCollector(stats_source, lora.max_loras if lora is not None and lora.enable_lora else None))
        if groups_source is not None:
            r.register(_GroupCollector(groups_source))
        if config is not None and info_source is not None:
            r.register(_CacheConfigCollector(config, info_source))
        self.registry.register(self.series if config is None else _Exported(self.series,
                                                                            config.model.served_model_name,
                                                                            config.api.metric_prefix))
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def on_client_error(self, exc: BaseException) -> None:
        """A request refused as invalid (an InvalidRequestError, 400), whichever transport carried it."""
        if isinstance(exc, InvalidRequestError):
            self.on_invalid_request()

    def on_invalid_request(self) -> None:
        """A request refused as invalid (400) before it became an InvalidRequestError: a transport's own refusal
        (a WebSocket frame or batch message it cannot read, an id already in use)."""
        self.rejected.labels("invalid").inc()

    def prompt(self, n: int = 1) -> "PromptMetrics":
        """The recorder of one prompt's `n` sequences (its choices); each gets its own from `sequence()`."""
        return PromptMetrics(self, n)

    def observe_steps(self, stats: SchedulerStats) -> None:
        for size in stats.step_batch_sizes:
            self.step_batch.observe(size)
        for tokens in stats.step_token_counts:
            self.step_tokens.observe(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class PromptMetrics:
    """One prompt's n sequences. As vLLM does, once the last of them has ended, and if any ran to a token, the
    prompt is observed once: n in shuttle:request_params_n, and the most tokens any of them generated in
    shuttle:request_max_num_generation_tokens.

    Attributes:
        n: the request's n parameter (how many sequences will report here).
        pending: sequences not yet ended.
        most_tokens: the most tokens one sequence generated so far.
        ran: whether any sequence got a token.
        refused: whether a sequence was refused at arrival: the prompt is counted once, in request_rejected, and
            its siblings ended with it are not counted again (as aborted or rejected).
    """

    metrics: Metrics
    n: int
    pending: int = field(init=False)
    most_tokens: int = 0
    ran: bool = False
    refused: bool = False

    def __post_init__(self):
        self.pending = self.n

    def sequence(self, num_prompt_tokens: int) -> "RequestMetrics":
        """The recorder of one of the prompt's sequences."""
        return RequestMetrics(self.metrics, num_prompt_tokens, self)

    def ended(self, sequence: "RequestMetrics") -> None:
        """One sequence's terminal outcome (each reports once)."""
        self.pending -= 1
        if sequence.first_token:
            self.ran = True
            self.most_tokens = max(self.most_tokens, sequence.num_tokens)
        if self.pending == 0 and self.ran:
            self.metrics.params_n.observe(self.n)
            self.metrics.max_generation_tokens.observe(self.most_tokens)


@dataclass
class RequestMetrics:
    """Times one sequence from arrival (time.time() seconds) to its one terminal outcome."""

    metrics: Metrics
    num_prompt_tokens: int
    prompt: PromptMetrics | None = None  # the prompt it is one of the n sequences of (None: a lone sequence)
    max_tokens: int = 0  # from the Submit (on_submit); 0: not known
    arrival: float = field(default_factory=time.time)
    first_scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    num_tokens: int = 0
    done: bool = False
    request: Submit | None = None  # from on_submit: its id and sampling name the trace span
    group: int | None = None  # the serving group it went to (set by its TextGeneration)
    # the W3C trace context of the HTTP request it came in (--otlp-traces-endpoint): its span's parent
    trace_headers: dict[str, str] | None = field(default_factory=TRACE_HEADERS.get)

    def on_submit(self, request: Submit) -> None:
        """The sequence goes to the engine: keep its max_tokens for shuttle:request_params_max_tokens."""
        self.max_tokens = request.sampling.max_tokens
        self.request = request

    def on_output(self, output: RequestOutput) -> None:
        now = time.time()
        count = len(output.new_token_ids)
        if count and not self.first_token:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
            if output.first_scheduled_time:
                self.first_scheduled = output.first_scheduled_time
                self.metrics.queue.observe(max(output.first_scheduled_time - self.arrival, 0.0))
                self.metrics.prefill.observe(max(now - output.first_scheduled_time, 0.0))
        elif count:
            self.metrics.itl.observe(now - self.last_token)
        if count:
            self.last_token = now
            self.num_tokens += count
            self.metrics.generation_tokens.inc(count)

    def on_finish(self, finish_reason: str) -> None:
        """Record the terminal outcome once: "stop", "length", "abort" or "error"."""
        if self.done:
            return
        self.done = True
        metrics = self.metrics
        if self.prompt is not None and self.prompt.refused and not self.first_token:
            self.prompt.ended(self)  # ended with its refused sibling: the prompt is counted as refused
            return
        metrics.finished.labels(finish_reason).inc()
        if metrics.tracer is not None:
            metrics.tracer.finish(self, finish_reason)
        if self.prompt is not None:
            self.prompt.ended(self)
        if not self.first_token:  # never ran to a token: no latencies, and no sizes (as vLLM counts)
            return
        metrics.e2e.observe(self.last_token - self.arrival)
        metrics.decode.observe(self.last_token - self.first_token)
        if self.num_tokens > 1:
            metrics.tpot.observe((self.last_token - self.first_token) / (self.num_tokens - 1))
        if self.first_scheduled:
            metrics.inference.observe(max(self.last_token - self.first_scheduled, 0.0))
        metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        metrics.request_generation_tokens.observe(self.num_tokens)
        if self.max_tokens:
            metrics.params_max_tokens.observe(self.max_tokens)

    def on_rejected(self, status: int, reason: str = "") -> None:
        """Count a refusal at arrival, once per prompt: `reason` when the scheduler gave one ("slo"), else by
        status."""
        if self.done:
            return
        self.done = True
        if self.prompt is not None:
            self.prompt.ended(self)
            if self.prompt.refused:
                return
            self.prompt.refused = True
        if self.metrics.tracer is not None:
            self.metrics.tracer.finish(self, "rejected")
        self.metrics.rejected.labels(reason or ("queue_full" if status == 503 else "never_fits")).inc()
