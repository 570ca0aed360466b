"""Issue 5 acceptance 1: after a known set of requests the /metrics counters are exact and every histogram has
one observation per request. Issue 28: every shuttle: series carries model_name, and vLLM's per-request series."""

import asyncio
import time

import aiohttp

from shuttle.common.config import CacheConfig, IpcConfig, ShuttleConfig
from shuttle.common.messages import RequestOutput, SchedulerInfo, SchedulerStats, Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.frontend.observability.metrics import Metrics, one_two_five
from tests.client import post_completion, stream_completion
from tests.conftest import hf_tokenizer
from tests.server import MODEL_DIR, ShuttleServer


def parse(text: str, model_name: str) -> dict[str, float]:
    """Sample -> value for every shuttle: series, keyed without the model_name label, which each must carry."""
    values = {}
    for line in text.splitlines():
        if line.startswith("shuttle:"):
            name, value = line.rsplit(" ", 1)
            label = f'model_name="{model_name}"'
            assert label in name, line
            name = name.replace(label + ",", "").replace("," + label, "").replace("{" + label + "}", "")
            values[name] = float(value)
    return values


async def test_metrics_counts_are_exact():
    srv = ShuttleServer("--max-waiting-requests", "2", "--max-num-seqs", "1", step_delay=0.02)
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
    assert values['shuttle:request_success_total{finished_reason="length"}'] == 3 + 1 + accepted
    assert values['shuttle:request_success_total{finished_reason="stop"}'] == 1
    assert values['shuttle:request_rejected_total{reason="invalid"}'] == 2
    assert values['shuttle:request_rejected_total{reason="queue_full"}'] == rejected
    assert values["shuttle:generation_tokens_total"] == 3 * 6 + 1 + 1 + 40 * accepted
    hi_tokens = len(hf_tokenizer()("Hi").input_ids)
    assert values["shuttle:prompt_tokens_total"] == 3 * 5 + 2 + 2 + hi_tokens * accepted
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert values[f"shuttle:{histogram}_count"] == finished, histogram
    # TPOT only exists for requests with more than one output token
    assert values["shuttle:request_time_per_output_token_seconds_count"] == 3 + accepted
    assert values["shuttle:inter_token_latency_seconds_count"] == 3 * 5 + 39 * accepted
    assert values["shuttle:num_requests_running"] == 0 and values["shuttle:num_requests_waiting"] == 0
    assert values["shuttle:iteration_tokens_total_count"] > 0
    # the per-request histograms: one observation per finished request, sums equal to the counters
    for histogram in ("request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                      "request_params_max_tokens"):
        assert values[f"shuttle:{histogram}_count"] == finished, histogram
    assert values["shuttle:request_prompt_tokens_sum"] == values["shuttle:prompt_tokens_total"]
    assert values["shuttle:request_generation_tokens_sum"] == values["shuttle:generation_tokens_total"]
    assert values["shuttle:request_params_max_tokens_sum"] == 3 * 6 + 1 + 5 + 40 * accepted
    # 1-2-5 buckets: "Once upon a time" (5 tokens) x 3, [1, 403] x 2, "Hi" x accepted
    assert values['shuttle:request_prompt_tokens_bucket{le="5.0"}'] == 3 + 2 + accepted * (hi_tokens <= 5)
    # every admitted prompt was looked up once (nothing was preempted); none holds a full 16-token block
    assert values["shuttle:prefix_cache_queries_total"] == values["shuttle:prompt_tokens_total"]
    assert values["shuttle:prefix_cache_hits_total"] == 0


def test_one_two_five_buckets_are_vllms():
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)


def test_request_params_and_cache_config_info():
    """n is observed by the one sequence of a prompt that carries it; cache_config_info has the cache's settings
    and the scheduler's block count; the process and GC collectors stand beside the model-labelled series."""
    config = ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR, served_model_name="m"), ipc=IpcConfig("", "", "", ""),
                           cache=CacheConfig(block_size=16, enable_prefix_caching=False))
    info = SchedulerInfo(num_kv_blocks=99, block_size=16, max_model_len=config.model.max_model_len)
    metrics = Metrics(lambda: SchedulerStats(), config=config, info_source=lambda: info)
    for j, n in enumerate((3, 0, 0)):  # one prompt, n=3: the first choice carries n
        sequence = metrics.request(7, n=n)
        sequence.on_submit(Submit(request_id=f"r-{j}", prompt_token_ids=[1] * 7, sampling=SamplingParams(max_tokens=4),
                                  arrival_time=time.time()))
        sequence.on_output(RequestOutput(request_id=f"r-{j}", new_token_ids=[5, 6], first_scheduled_time=time.time()))
        sequence.on_finish("length")
    text = metrics.render().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert samples['shuttle:request_params_n_count{model_name="m"}'] == "1.0"
    assert samples['shuttle:request_params_n_sum{model_name="m"}'] == "3.0"
    assert samples['shuttle:request_params_max_tokens_sum{model_name="m"}'] == "12.0"
    assert samples['shuttle:request_generation_tokens_sum{model_name="m"}'] == "6.0"
    assert samples['shuttle:request_prompt_tokens_sum{model_name="m"}'] == "21.0"
    assert samples['shuttle:request_inference_time_seconds_count{model_name="m"}'] == "3.0"
    info_line = next(name for name in samples if name.startswith("shuttle:cache_config_info{"))
    for label in ('block_size="16"', 'num_gpu_blocks="99"', 'enable_prefix_caching="False"', 'model_name="m"'):
        assert label in info_line
    assert all('model_name="m"' in name for name in samples if name.startswith("shuttle:"))
    assert "process_cpu_seconds_total" in samples and any(name.startswith("python_gc_") for name in samples)
