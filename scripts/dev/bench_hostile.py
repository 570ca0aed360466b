#!/usr/bin/env python3
"""Hostile constraints and bodies beside plain and constrained canaries: does any client stall the engine or the
frontend, grow the worker for good, or lose a request?

One `shuttle serve` (--model, with --step-log) on loopback. For --duration seconds, all at once:
- canaries: --plain streaming completions (64 tokens each, again and again) and --constrained ones under a small
  regex, timed per token and per request;
- a /health prober every 50 ms (its slowest answer bounds how long the frontend's event loop stood still);
- hostile clients, each in a loop: tool parameters nested 300 deep, huge enums (distinct schemas of about 230 KB), many
  distinct small regexes, a remote `$ref`, pathological regexes, and 40,000-item /v1/responses bodies.
Every request is bounded (120 s) and counted; a request with no terminal answer in that time, or a connection
dropped without one, is lost. Reported: the longest step (the server's step log), the slowest /health, the canaries'
longest gap between tokens and longest constrained request, the worker's RSS growth, requests by outcome, lost.
Aims: no step over 1 s, no /health over 0.5 s, 0 lost. No assertions: it prints a table and writes JSON.

    .venv/bin/python scripts/dev/bench_hostile.py --duration 60 --json /tmp/hostile.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.common.config import DEFAULT_MODEL_DIR  # noqa: E402
from shuttle.launcher.local_server import ShuttleServer  # noqa: E402
from shuttle.scheduler.step_log import read_step_log  # noqa: E402

REQUEST_BOUND_S = 120.0


def nested_tool(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return {"type": "function", "function": {"name": "deep", "parameters": schema}}


def enum_schema(i: int, values: int = 18_000) -> dict:
    return {"type": "object", "properties": {"k": {"type": "string", "enum": [f"v{i}-{j}" for j in range(values)]}},
            "required": ["k"]}


def calls_body(num_calls: int) -> dict:
    items = [{"type": "message", "role": "user", "content": "Hi"}]
    items += [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(num_calls)]
    return {"input": items, "max_output_tokens": 4}


PATHOLOGICAL = ["(a|aa)*b", "((a*)*)*c", "(a|b|ab|ba)*(a|b){12}", "([a-z]{1,30}){1,30}", "(x+x+)+y"]


class Tally:
    """Outcomes of every request: status codes, lost (no terminal answer), and latencies by kind."""

    def __init__(self):
        self.outcomes: Counter = Counter()
        self.lost = 0
        self.worst: dict[str, float] = {}

    def note(self, kind: str, seconds: float) -> None:
        self.worst[kind] = max(self.worst.get(kind, 0.0), seconds)


async def post(session, tally: Tally, url: str, body: dict, kind: str) -> None:
    start = time.monotonic()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_BOUND_S)) as r:
            await r.read()
            tally.outcomes[f"{kind} {r.status}"] += 1
    except (asyncio.TimeoutError, aiohttp.ClientError):
        tally.lost += 1
        tally.outcomes[f"{kind} lost"] += 1
    tally.note(kind, time.monotonic() - start)


async def stream_canary(session, tally: Tally, url: str, body: dict, kind: str) -> None:
    """One streamed completion; the longest gap between its events is noted as `kind` gap."""
    start = last = time.monotonic()
    try:
        async with session.post(url, json={**body, "stream": True},
                                timeout=aiohttp.ClientTimeout(total=REQUEST_BOUND_S)) as r:
            ended = False
            async for line in r.content:
                now = time.monotonic()
                tally.note(f"{kind} gap", now - last)
                last = now
                ended = ended or line.strip() == b"data: [DONE]"
            tally.outcomes[f"{kind} {r.status}" if ended or r.status != 200 else f"{kind} lost"] += 1
            tally.lost += r.status == 200 and not ended
    except (asyncio.TimeoutError, aiohttp.ClientError):
        tally.lost += 1
        tally.outcomes[f"{kind} lost"] += 1
    tally.note(kind, time.monotonic() - start)


async def loop_until(deadline: float, make) -> None:
    i = 0
    while time.monotonic() < deadline:
        await make(i)
        i += 1


async def probe_health(session, tally: Tally, base: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=REQUEST_BOUND_S)) as r:
                await r.read()
        except (asyncio.TimeoutError, aiohttp.ClientError):
            tally.outcomes["health lost"] += 1
        tally.note("health", time.monotonic() - start)
        await asyncio.sleep(0.05)


async def run(base: str, args) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + args.duration
    completions, chat, responses = f"{base}/v1/completions", f"{base}/v1/chat/completions", f"{base}/v1/responses"
    user = [{"role": "user", "content": "Tell me a story."}]
    plain = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True}
    constrained = {"prompt": "Once upon a time", "max_tokens": 16, "structured_outputs": {"regex": "[a-z]{1,8}"}}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [probe_health(session, tally, base, deadline)]
        tasks += [loop_until(deadline, lambda i: stream_canary(session, tally, completions, plain, "plain canary"))
                  for _ in range(args.plain)]
        tasks += [loop_until(deadline, lambda i: stream_canary(session, tally, completions, constrained,
                                                               "constrained canary")) for _ in range(args.constrained)]
        hostile = {
            "deep tool": lambda i: post(session, tally, chat, {"messages": user, "tools": [nested_tool(300)],
                                                               "tool_choice": "required"}, "deep tool"),
            "huge enum": lambda i: post(session, tally, completions, {"prompt": "Hi", "max_tokens": 8,
                                                                      "response_format": {
                "type": "json_schema", "json_schema": {"name": "e", "schema": enum_schema(i % args.enums)}}},
                "huge enum"),
            "distinct regex": lambda i: post(session, tally, completions, {
                "prompt": "Hi", "max_tokens": 4, "structured_outputs": {"regex": f"[a-z]{{1,{i % 5000 + 1}}}"}},
                "distinct regex"),
            "remote ref": lambda i: post(session, tally, chat, {"messages": user, "response_format": {
                "type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "https://example.com/x"}}}},
                "remote ref"),
            "pathological regex": lambda i: post(session, tally, completions, {
                "prompt": "Hi", "max_tokens": 8, "structured_outputs": {"regex": PATHOLOGICAL[i % len(PATHOLOGICAL)]
                                                                        + f"{{0,{i % 7}}}"}},
                "pathological regex"),
            "40k-item body": lambda i: post(session, tally, responses, calls_body(40_000), "40k-item body"),
        }
        tasks += [loop_until(deadline, make) for make in hostile.values()]
        await asyncio.gather(*tasks)
    return tally


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--plain", type=int, default=4, help="plain streaming canaries")
    parser.add_argument("--constrained", type=int, default=2, help="constrained canaries")
    parser.add_argument("--enums", type=int, default=4, help="distinct huge-enum schemas")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    step_log = Path(tempfile.mkdtemp()) / "steps.jsonl"
    # a chat template, so that chat bodies (tools) reach the engine's checks on the default model too
    with ShuttleServer("--step-log", str(step_log), "--chat-template", str(REPO / "tests/data/stories_chat.jinja"),
                       model_dir=args.model) as server:
        worker = server.pids["worker"]
        rss_before = rss_kib(worker)
        tally = asyncio.run(run(server.url, args))
        rss_after = rss_kib(worker) if worker == server.pids.get("worker") else 0
        restarts = server.restarts
    steps = read_step_log(step_log)
    result = {
        "max_step_s": max((s.seconds for s in steps), default=0.0),
        "max_health_s": tally.worst.get("health", 0.0),
        "plain_canary_max_gap_s": tally.worst.get("plain canary gap", 0.0),
        "constrained_canary_max_s": tally.worst.get("constrained canary", 0.0),
        "worker_rss_growth_mib": (rss_after - rss_before) / 1024 if rss_after else None,
        "engine_restarts": restarts,
        "lost": tally.lost,
        "outcomes": dict(sorted(tally.outcomes.items())),
        "worst_s": {k: round(v, 3) for k, v in sorted(tally.worst.items())},
        "duration_s": args.duration,
    }
    print(f"{'measure':32} {'value':>10}  aim")
    for name, aim in (("max_step_s", "< 1 s"), ("max_health_s", "< 0.5 s"), ("plain_canary_max_gap_s", ""),
                      ("constrained_canary_max_s", ""), ("worker_rss_growth_mib", ""), ("engine_restarts", "0"),
                      ("lost", "0")):
        value = result[name]
        print(f"{name:32} {value if value is None or isinstance(value, int) else round(value, 3):>10}  {aim}")
    for name, count in result["outcomes"].items():
        print(f"  {name:30} {count:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
