"""Issue 5 acceptance 1: after a known set of requests the /metrics counters are exact and every histogram has
one observation per request. Issue 28: every shuttle: series carries model_name, and vLLM's per-request series.
Issue 43: under --metric-prefix vllm, every series and label vLLM's own Grafana dashboard queries is served."""

import asyncio
import time

import aiohttp

from shuttle.common.config import ApiConfig, CacheConfig, IpcConfig, ShuttleConfig
from shuttle.common.messages import RequestOutput, SchedulerInfo, SchedulerStats, Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.frontend.observability.metrics import Metrics, one_two_five
from tests.client import post_completion, stream_completion
from tests.conftest import hf_tokenizer
from tests.server import MODEL_DIR, ShuttleServer

# What vLLM's Grafana dashboard (examples/observability/prometheus_grafana/grafana.json in vLLM's repository) queries:
# each series its expressions select, and the labels they filter or group by. Every selector filters by
# model_name="$model_name", whose values the dashboard lists from label_values({__name__=~"vllm:.*"}, model_name).
VLLM_DASHBOARD_SERIES = {
    # E2E Request Latency, TTFT, Inter Token Latency, TPOT: p50/p90/p95/p99 by le, and sum / count
    **{f"vllm:{histogram}_{part}": ("le",) if part == "bucket" else ()
       for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds",
                         "request_time_per_output_token_seconds") for part in ("bucket", "sum", "count")},
    "vllm:prompt_tokens_total": (), "vllm:generation_tokens_total": (),  # Token Throughput
    "vllm:num_requests_running": (), "vllm:num_requests_waiting": (),  # Scheduler State
    "vllm:kv_cache_usage_perc": (),  # Cache Utilization
    "vllm:request_prompt_tokens_bucket": ("le",), "vllm:request_generation_tokens_bucket": ("le",),  # heatmaps
    "vllm:request_success_total": ("finished_reason",),  # Finish Reason
    "vllm:request_queue_time_seconds_sum": (),  # Queue Time
    "vllm:request_prefill_time_seconds_sum": (), "vllm:request_decode_time_seconds_sum": (),
    "vllm:request_max_num_generation_tokens_sum": (),  # Max Generation Token in Sequence Group
}
GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}


def parse(text: str, model_name: str) -> dict[str, float]:
    """Sample -> value for every vllm: series, keyed without the model_name label, which each must carry; no series is
    left under shuttle's own prefix."""
    values = {}
    for line in text.splitlines():
        assert not line.startswith("shuttle:"), line
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            label = f'model_name="{model_name}"'
            assert label in name, line
            name = name.replace(label + ",", "").replace("," + label, "").replace("{" + label + "}", "")
            values[name] = float(value)
    return values


def assert_vllm_dashboard_served(values: dict[str, float]) -> None:
    """Each series vLLM's dashboard queries has samples (those it takes a rate of, observations), and each label its
    queries group by is on them."""
    for series, labels in VLLM_DASHBOARD_SERIES.items():
        rows = {name: value for name, value in values.items() if name.split("{")[0] == series}
        assert rows, f"{series}: not served"
        for label in labels:
            assert all(f'{label}="' in name for name in rows), (series, label)
        if series not in GAUGES:
            assert sum(rows.values()) > 0, f"{series}: no data"


async def test_metrics_counts_are_exact():
    srv = ShuttleServer("--max-waiting-requests", "2", "--max-num-seqs", "1", "--metric-prefix", "vllm",
                        step_delay=0.02)
    try:
        async with aiohttp.ClientSession() as session:
            # 3 finished by length (ignore_eos, 6 tokens each), streamed and not
            for stream in (False, True, False):
                body = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
                if stream:
                    await stream_completion(session, srv.url, **body)
                else:
                    status, _ = await post_completion(session, srv.url, **body)
                    assert status == 200
            # 1 finished by a stop token id: the first greedy token of this prompt, so 1 output token
            status, first = await post_completion(session, srv.url, prompt=[1, 403], max_tokens=1, temperature=0,
                                                  return_token_ids=True)
            stop_id = first["choices"][0]["token_ids"][0]
            status, stopped = await post_completion(session, srv.url, prompt=[1, 403], max_tokens=5, temperature=0,
                                                    stop_token_ids=[stop_id])
            assert stopped["choices"][0]["finish_reason"] == "stop"
            # 2 invalid requests
            for bad in ({"prompt": "Hi", "max_tokens": -1}, {"max_tokens": 3}):
                status, _ = await post_completion(session, srv.url, **bad)
                assert status == 400
            # queue-full rejections: 1 running (long) + 2 waiting fill everything; the rest get 503
            long_job = {"prompt": "Hi", "max_tokens": 40, "ignore_eos": True}
            results = await asyncio.gather(*(post_completion(session, srv.url, **long_job) for _ in range(6)))
            statuses = sorted(s for s, _ in results)
            accepted, rejected = statuses.count(200), statuses.count(503)
            assert accepted + rejected == 6 and rejected >= 1
            async with session.get(f"{srv.url}/v1/models") as response:
                model_name = (await response.json())["data"][0]["id"]
            async with session.get(f"{srv.url}/metrics") as response:
                assert response.status == 200
                values = parse(await response.text(), model_name)
    finally:
        srv.stop()

    finished = 3 + 1 + 1 + accepted  # the max_tokens=1 probe finished by length too
    assert values['vllm:request_success_total{finished_reason="length"}'] == 3 + 1 + accepted
    assert values['vllm:request_success_total{finished_reason="stop"}'] == 1
    assert values['vllm:request_rejected_total{reason="invalid"}'] == 2
    assert values['vllm:request_rejected_total{reason="queue_full"}'] == rejected
    assert values["vllm:generation_tokens_total"] == 3 * 6 + 1 + 1 + 40 * accepted
    hi_tokens = len(hf_tokenizer()("Hi").input_ids)
    assert values["vllm:prompt_tokens_total"] == 3 * 5 + 2 + 2 + hi_tokens * accepted
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert values[f"vllm:{histogram}_count"] == finished, histogram
    # TPOT only exists for requests with more than one output token
    assert values["vllm:request_time_per_output_token_seconds_count"] == 3 + accepted
    assert values["vllm:inter_token_latency_seconds_count"] == 3 * 5 + 39 * accepted
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:iteration_tokens_total_count"] > 0
    # the per-request histograms: one observation per finished request, sums equal to the counters
    for histogram in ("request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                      "request_params_max_tokens"):
        assert values[f"vllm:{histogram}_count"] == finished, histogram
    assert values["vllm:request_prompt_tokens_sum"] == values["vllm:prompt_tokens_total"]
    assert values["vllm:request_generation_tokens_sum"] == values["vllm:generation_tokens_total"]
    assert values["vllm:request_params_max_tokens_sum"] == 3 * 6 + 1 + 5 + 40 * accepted
    # 1-2-5 buckets: "Once upon a time" (5 tokens) x 3, [1, 403] x 2, "Hi" x accepted
    assert values['vllm:request_prompt_tokens_bucket{le="5.0"}'] == 3 + 2 + accepted * (hi_tokens <= 5)
    # every admitted prompt was looked up once (nothing was preempted); none holds a full 16-token block
    assert values["vllm:prefix_cache_queries_total"] == values["vllm:prompt_tokens_total"]
    assert values["vllm:prefix_cache_hits_total"] == 0
    # one observation per prompt: every one here had n = 1, so the most tokens of a choice is its own count
    assert values["vllm:request_max_num_generation_tokens_count"] == finished
    assert values["vllm:request_max_num_generation_tokens_sum"] == values["vllm:generation_tokens_total"]
    assert_vllm_dashboard_served(values)


def test_one_two_five_buckets_are_vllms():
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)


def feed(metrics: Metrics, tokens_per_choice: list[int], prompt_tokens: int = 7) -> None:
    """One prompt whose n = len(tokens_per_choice) choices generate that many tokens each, in turn (0: the choice
    ends with no token, as an abort before its first)."""
    prompt = metrics.prompt(len(tokens_per_choice))
    for j, count in enumerate(tokens_per_choice):
        sequence = prompt.sequence(prompt_tokens)
        sequence.on_submit(Submit(request_id=f"r-{j}", prompt_token_ids=[1] * prompt_tokens,
                                  sampling=SamplingParams(max_tokens=4), arrival_time=time.time()))
        if count:
            sequence.on_output(RequestOutput(request_id=f"r-{j}", new_token_ids=[5] * count,
                                             first_scheduled_time=time.time()))
        sequence.on_finish("length" if count else "abort")


def samples_of(metrics: Metrics) -> dict[str, str]:
    text = metrics.render().decode()
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


def labelled_config(prefix: str = "shuttle") -> ShuttleConfig:
    return ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR, served_model_name="m"), ipc=IpcConfig("", "", "", ""),
                         cache=CacheConfig(block_size=16, enable_prefix_caching=False),
                         api=ApiConfig(metric_prefix=prefix))


def test_request_params_and_cache_config_info():
    """n and the most tokens a choice generated are observed once per prompt, when its last choice ends;
    cache_config_info has the cache's settings and the scheduler's block count; the process and GC collectors stand
    beside the model-labelled series."""
    config = labelled_config()
    info = SchedulerInfo(num_kv_blocks=99, block_size=16, max_model_len=config.model.max_model_len)
    metrics = Metrics(lambda: SchedulerStats(), config=config, info_source=lambda: info)
    prompt = metrics.prompt(3)
    sequences = [prompt.sequence(7) for _ in range(3)]
    for j, (sequence, count) in enumerate(zip(sequences, (2, 5, 3))):
        sequence.on_submit(Submit(request_id=f"r-{j}", prompt_token_ids=[1] * 7, sampling=SamplingParams(max_tokens=4),
                                  arrival_time=time.time()))
        sequence.on_output(RequestOutput(request_id=f"r-{j}", new_token_ids=[5] * count,
                                         first_scheduled_time=time.time()))
    for sequence in sequences[:2]:
        sequence.on_finish("length")
    # a prompt is observed when its last choice ends, not before
    assert samples_of(metrics)['shuttle:request_max_num_generation_tokens_count{model_name="m"}'] == "0.0"
    sequences[2].on_finish("length")
    feed(metrics, [0])  # a prompt whose one choice never ran to a token: not observed (as vLLM counts)
    samples = samples_of(metrics)
    assert samples['shuttle:request_params_n_count{model_name="m"}'] == "1.0"
    assert samples['shuttle:request_params_n_sum{model_name="m"}'] == "3.0"
    assert samples['shuttle:request_max_num_generation_tokens_count{model_name="m"}'] == "1.0"
    assert samples['shuttle:request_max_num_generation_tokens_sum{model_name="m"}'] == "5.0"
    # vLLM's 1-2-5 buckets up to max_model_len
    assert samples['shuttle:request_max_num_generation_tokens_bucket{le="2.0",model_name="m"}'] == "0.0"
    assert samples['shuttle:request_max_num_generation_tokens_bucket{le="5.0",model_name="m"}'] == "1.0"
    assert samples['shuttle:request_params_max_tokens_sum{model_name="m"}'] == "12.0"
    assert samples['shuttle:request_generation_tokens_sum{model_name="m"}'] == "10.0"
    assert samples['shuttle:request_prompt_tokens_sum{model_name="m"}'] == "21.0"
    assert samples['shuttle:request_inference_time_seconds_count{model_name="m"}'] == "3.0"
    info_line = next(name for name in samples if name.startswith("shuttle:cache_config_info{"))
    for label in ('block_size="16"', 'num_gpu_blocks="99"', 'enable_prefix_caching="False"', 'model_name="m"'):
        assert label in info_line
    assert all('model_name="m"' in name for name in samples if name.startswith("shuttle:"))
    assert "process_cpu_seconds_total" in samples and any(name.startswith("python_gc_") for name in samples)


def test_metric_prefix_vllm_renames_every_series_and_nothing_else():
    """--metric-prefix vllm: the same families, samples, labels and values, each named vllm: instead of shuttle:
    (HELP and TYPE lines too); the process and GC collectors keep their own names."""
    info = SchedulerInfo(num_kv_blocks=99, block_size=16, max_model_len=512)
    stats = SchedulerStats(num_running=2, num_waiting=1, num_blocks_in_use=3, num_total_blocks=12)
    texts = {}
    for prefix in ("shuttle", "vllm"):
        metrics = Metrics(lambda: stats, config=labelled_config(prefix), info_source=lambda: info)
        feed(metrics, [2, 4])
        texts[prefix] = metrics.render().decode()
    ours = [line for line in texts["shuttle"].splitlines() if "shuttle:" in line]
    theirs = [line for line in texts["vllm"].splitlines() if "vllm:" in line]
    assert "shuttle:" not in texts["vllm"] and len(ours) > 100
    def shape(line: str) -> str:  # a latency or a creation time differs between the two runs; the rest must not
        timed = not line.startswith("#") and ("_seconds_" in line or "_created{" in line)
        return line.rsplit(" ", 1)[0] if timed else line

    assert [shape(line).replace("vllm:", "shuttle:") for line in theirs] == [shape(line) for line in ours]
    for name in ('vllm:num_requests_waiting{model_name="m"} 1.0', 'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
                 'vllm:request_max_num_generation_tokens_sum{model_name="m"} 4.0',
                 "# TYPE vllm:prompt_tokens_total counter",
                 'vllm:request_success_total{finished_reason="length",model_name="m"} 2.0'):
        assert name in theirs, name
    assert "process_cpu_seconds_total" in texts["vllm"]
