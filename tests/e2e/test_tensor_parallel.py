"""Issue 13, tensor parallel: `--tensor-parallel-size 2` on CPU (gloo) serves stories260K (8 heads, 4 KV heads)
token-exact against transformers, streamed and not, with chunked prefill and preemption; each rank holds half the
KV heads; the group's KV capacity is its ranks' minimum; every rank gets every plan; a head count the size does not
divide is refused at start-up; a killed rank restarts the engine.

One real server for the module (its last test kills a rank); the rest runs in process.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp
import msgspec
import pytest
import zmq

from shuttle.capacity.story_prompts import STORY
from shuttle.common.config import CacheConfig, IpcConfig, ParallelConfig, ShuttleConfig, tensor_parallel_error
from shuttle.common.ipc import Channel
from shuttle.common.messages import PlanMessage, StepPlan, Submit, WorkerReady
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.launcher.supervised_unit import engine_roles, worker_rank
from shuttle.scheduler.loop import SchedulerLoop
from tests.client import health, post_completion
from tests.conftest import hf_greedy, hf_tokenizer
from tests.server import MODEL_DIR, REPO, ShuttleServer

NUM_KV_BLOCKS = 7  # 112 tokens for requests that need 15 blocks together (each fits alone): preemption is certain
PROMPT_LENGTHS = (1, 23, 41, 70)  # tokens of the story's start; the longest is prefilled in 5 chunks
MAX_TOKENS = (30, 24, 20, 24)


@pytest.fixture(scope="module")
def lora_adapter(tmp_path_factory):
    """A LoRA adapter on every projection of stories260K: column-parallel (q/k/v, gate/up) and row-parallel (o,
    down)."""
    from tests.engine.test_lora_engine import write_adapter

    targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    return write_adapter(tmp_path_factory.mktemp("lora") / "every", MODEL_DIR, targets, rank=4, alpha=8, seed=7)


@pytest.fixture(scope="module")
def tp_server(lora_adapter):
    srv = ShuttleServer("--tensor-parallel-size", "2", "--max-num-batched-tokens", "16", "--num-kv-blocks",
                        str(NUM_KV_BLOCKS), "--max-restarts", "3", "--enable-lora", "--lora-modules",
                        f"every={lora_adapter}")
    yield srv
    srv.stop()


async def greedy(session, url: str, prompt: list[int], max_tokens: int, stream: bool) -> list[int]:
    """The greedy output token ids of one request, read from the stream's chunks or from the whole answer."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    if not stream:
        status, answer = await post_completion(session, url, **body)
        assert status == 200, answer
        return answer["choices"][0]["token_ids"]
    tokens = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                tokens.extend(chunk["choices"][0]["token_ids"])
    return tokens


async def test_tp2_greedy_equals_transformers_streamed_chunked_and_preempted(tp_server):
    story = hf_tokenizer()(STORY).input_ids
    prompts = [story[:n] for n in PROMPT_LENGTHS]
    assert sum(-(-(len(p) + m) // 16) for p, m in zip(prompts, MAX_TOKENS)) > 2 * NUM_KV_BLOCKS
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        before = (await health(session, tp_server.url))["scheduler"]
        outputs = await asyncio.gather(*(greedy(session, tp_server.url, p, m, stream=i % 2 == 0)
                                         for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))))
        after = (await health(session, tp_server.url))["scheduler"]
    for prompt, max_tokens, output in zip(prompts, MAX_TOKENS, outputs):
        assert output == hf_greedy(prompt, max_tokens), f"prompt of {len(prompt)} tokens"
    assert after["num_total_blocks"] == NUM_KV_BLOCKS
    assert after["num_preemptions"] > before["num_preemptions"]  # preemption did happen, and recomputed exactly
    print(f"preemptions: {after['num_preemptions'] - before['num_preemptions']}")


async def test_tp2_serves_an_adapter_and_the_base_model_in_one_batch(tp_server, lora_adapter):
    """Each rank holds its shard of the adapter (B's rows for column-parallel layers, A's columns for row-parallel
    ones, their delta all-reduced): greedy output through the adapter equals transformers on weights merged by hand,
    and the base model's requests beside it equal plain transformers."""
    from tests.engine.test_lora_engine import MAX_TOKENS as LORA_TOKENS
    from tests.engine.test_lora_engine import merged_greedy

    prompts = [[1, 15, 27, 99, 300, 41, 7], [1, 400, 23, 8, 91]]
    want, base = merged_greedy(MODEL_DIR, lora_adapter, prompts), merged_greedy(MODEL_DIR, None, prompts)
    assert want != base  # the adapter changes the output
    body = {"max_tokens": LORA_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        answers = await asyncio.gather(*(post_completion(session, tp_server.url, prompt=p, model=model, **body)
                                         for p in prompts for model in ("every", None)))
    got = [answer["choices"][0]["token_ids"] for status, answer in answers if status == 200]
    assert len(got) == 4 and [got[0], got[2]] == want
    assert [got[1], got[3]] == base


def test_each_rank_holds_half_the_kv_heads(tp_server):
    # stories260K: 5 layers x 4 KV heads x (8 + 8) dims x 4 bytes = 1280 bytes/token unsharded
    assert any(line.startswith(f"shuttle: KV cache {NUM_KV_BLOCKS} blocks x 16 tokens") and "(640 bytes/token)" in line
               for line in tp_server.output), tp_server.output
    assert set(tp_server.pids) == {"worker", "worker1", "scheduler", "frontend"}


def test_heads_not_divisible_are_refused_before_start():
    result = subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "serve", str(MODEL_DIR), "--port", "0",
                             "--tensor-parallel-size", "3"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert ("--tensor-parallel-size 3 does not divide the model's 8 attention heads (each rank must hold the same "
            "number of whole heads)") in result.stderr
    assert "ready" not in result.stdout


def test_refusal_names_kv_heads():
    assert tensor_parallel_error({"num_attention_heads": 8, "num_key_value_heads": 4}, 2) is None
    assert tensor_parallel_error({"num_attention_heads": 8, "num_key_value_heads": 4}, 1) is None
    assert "the model's 4 KV heads" in tensor_parallel_error({"num_attention_heads": 8, "num_key_value_heads": 4}, 8)
    assert "12 attention heads" in tensor_parallel_error({"text_config": {"num_attention_heads": 12}}, 8)


def test_engine_roles_name_each_rank():
    assert engine_roles(1) == ("worker", "scheduler")
    assert engine_roles(3) == ("worker", "worker1", "worker2", "scheduler")
    assert [worker_rank(r) for r in ("worker", "worker2", "scheduler", "frontend")] == [0, 2, None, None]


def test_scheduler_takes_the_smallest_rank_capacity_and_sends_every_plan_to_every_rank():
    with tempfile.TemporaryDirectory() as runtime:
        ipc = IpcConfig.in_directory(runtime, tensor_parallel_size=2)
        model = ModelConfig.from_dir(MODEL_DIR)
        config = ShuttleConfig(model, ipc, cache=CacheConfig(num_kv_blocks=None), parallel=ParallelConfig(2))
        ctx = zmq.Context()
        loop = SchedulerLoop(config, ctx)
        results = Channel(ctx, zmq.PUSH, ipc.results, bind=False)
        ranks = [Channel(ctx, zmq.PULL, ipc.plans_of(r), bind=False, recv_type=PlanMessage) for r in range(2)]
        try:
            results.send(WorkerReady(rank=1, num_kv_blocks=70, kv_bytes_per_token=640, weight_bytes=1000))
            results.send(WorkerReady(rank=0, num_kv_blocks=90, kv_bytes_per_token=640, weight_bytes=1000))
            ready = loop.wait_for_worker()
            assert (ready.rank, ready.num_kv_blocks) == (0, 70)
            assert loop.scheduler.kv.pool.num_blocks == 70
            submit = Submit(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4),
                            arrival_time=time.time())
            loop.scheduler.add_request(b"client", submit)
            assert loop._plan_and_send()
            plans = [rank.recv() for rank in ranks]
            assert isinstance(plans[0], StepPlan) and plans[0].new_requests[0].request_id == "r1"
            assert msgspec.msgpack.encode(plans[0]) == msgspec.msgpack.encode(plans[1])
        finally:
            for channel in (results, *ranks, loop.results, loop.frontends, *loop.plans):
                channel.close()
            ctx.term()


async def test_killed_rank_restarts_the_engine(tp_server):
    """Runs last: kill -9 of rank 1 mid-stream ends the stream with one error; the engine comes back exact."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        events = []
        body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "temperature": 0, "stream": True}
        restarts, victim = tp_server.restarts, tp_server.pids["worker1"]
        async with session.post(f"{tp_server.url}/v1/completions", json=body) as response:
            async for raw in response.content:
                if raw.startswith(b"data: "):
                    events.append(raw[6:].decode().strip())
                    if len(events) == 3:
                        os.kill(victim, signal.SIGKILL)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
        assert all("error" not in json.loads(e) for e in events[:-2])  # exactly one terminal error
        tp_server.wait_restarts(restarts + 1)
        assert any("worker1" in line and "SIGKILL" in line and "restarts in" in line for line in tp_server.output)
        assert tp_server.pids["worker1"] != victim
        deadline = time.monotonic() + 120
        while True:  # the frontend learns of the new scheduler within a moment of the launcher's announcement
            async with session.get(f"{tp_server.url}/health") as response:
                if response.status == 200:
                    break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        ids = [1, 403, 407, 261, 378]  # "Once upon a time"
        status, answer = await post_completion(
            session, tp_server.url, prompt=ids, max_tokens=24, temperature=0, return_token_ids=True
        )
        assert status == 200 and answer["choices"][0]["token_ids"] == hf_greedy(ids, 24)
