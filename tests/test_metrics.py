"""Issue 5 acceptance 1: after a known set of requests the /metrics counters are exact and every histogram has
one observation per request."""

import asyncio

import aiohttp

from tests.conftest import hf_tokenizer
from tests.client import post_completion, stream_completion
from tests.server import ShuttleServer


def parse(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
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
            async with session.get(f"{srv.url}/metrics") as response:
                assert response.status == 200
                values = parse(await response.text())
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
    # every admitted prompt was looked up once (nothing was preempted); none holds a full 16-token block
    assert values["shuttle:prefix_cache_queries_total"] == values["shuttle:prompt_tokens_total"]
    assert values["shuttle:prefix_cache_hits_total"] == 0
