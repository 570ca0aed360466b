"""Prometheus metrics of what clients feel, named like vLLM's under the `shuttle:` prefix.

Request-level latencies are measured here, in the frontend, where the client's experience is. Scheduler
figures (queue lengths, KV usage, prefix cache, preemptions) come from the scheduler's periodic stats
messages and are read at scrape time; the frontend never waits for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.messages import RequestOutput, SchedulerStats

# Latency buckets in seconds (vLLM's choices, extended up for CPU serving).
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _SchedulerCollector:
    """Exposes the latest SchedulerStats snapshot as gauges and counters."""

    def __init__(self, stats_source):
        self._stats = stats_source

    def collect(self):
        stats: SchedulerStats = self._stats()
        gauges = {"num_requests_running": ("Requests in the running set.", stats.num_running),
                  "num_requests_waiting": ("Requests in the waiting queue.", stats.num_waiting),
                  "kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full).",
                                          stats.num_blocks_in_use / max(stats.num_total_blocks, 1))}
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"shuttle:{name}", doc, value=value)
        counters = {"prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
                    "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
                    "num_preemptions": ("Requests preempted (recomputed later).", stats.num_preemptions)}
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"shuttle:{name}", doc, value=value)


class _GroupCollector:
    """Per serving group (data parallelism), labelled group="i": up, queues, KV usage, failures, routed."""

    def __init__(self, groups_source):
        self._groups = groups_source

    def collect(self):
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
    """

    def __init__(self, stats_source, groups_source=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("shuttle:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY, registry=r)
        self.itl = Histogram("shuttle:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_LATENCY, registry=r)
        self.tpot = Histogram("shuttle:request_time_per_output_token_seconds",
                              "Per request: (finish - first token) / (output tokens - 1).", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("shuttle:e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY,
                             registry=r)
        self.queue = Histogram("shuttle:request_queue_time_seconds", "Arrival to first scheduled.", buckets=_LATENCY,
                               registry=r)
        self.prefill = Histogram("shuttle:request_prefill_time_seconds", "First scheduled to first token.",
                                 buckets=_LATENCY, registry=r)
        self.decode = Histogram("shuttle:request_decode_time_seconds", "First token to last token.", buckets=_LATENCY,
                                registry=r)
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
        r.register(_SchedulerCollector(stats_source))
        if groups_source is not None:
            r.register(_GroupCollector(groups_source))

    def request(self, num_prompt_tokens: int) -> "RequestMetrics":
        return RequestMetrics(self, num_prompt_tokens)

    def observe_steps(self, stats: SchedulerStats) -> None:
        for size in stats.step_batch_sizes:
            self.step_batch.observe(size)
        for tokens in stats.step_token_counts:
            self.step_tokens.observe(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class RequestMetrics:
    """Times one sequence from arrival (time.time() seconds) to its one terminal outcome."""

    metrics: Metrics
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.time)
    first_token: float = 0.0
    last_token: float = 0.0
    num_tokens: int = 0
    done: bool = False

    def on_output(self, output: RequestOutput) -> None:
        now = time.time()
        count = len(output.new_token_ids)
        if count and not self.first_token:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
            if output.first_scheduled_time:
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
        self.metrics.finished.labels(finish_reason).inc()
        if self.first_token:
            self.metrics.e2e.observe(self.last_token - self.arrival)
            self.metrics.decode.observe(self.last_token - self.first_token)
            if self.num_tokens > 1:
                self.metrics.tpot.observe((self.last_token - self.first_token) / (self.num_tokens - 1))

    def on_rejected(self, status: int, reason: str = "") -> None:
        """Count a refusal at arrival: `reason` when the scheduler gave one ("slo"), else by status."""
        self.done = True
        self.metrics.rejected.labels(reason or ("queue_full" if status == 503 else "never_fits")).inc()
