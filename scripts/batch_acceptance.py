#!/usr/bin/env python3
"""Measure issue 11's acceptance 1-4 once against real `shuttle serve` processes (stories260K by default).

1. an N-line OpenAI batch file (completions and chat, malformed lines, invalid bodies) -> exactly N output lines,
   one per custom_id, errors with HTTP's status, greedy texts equal to the same requests over HTTP;
2. kill -9 of `shuttle batch` halfway -> /health shows the dead client's jobs aborted (seconds measured), and a
   rerun completes with no duplicate and no missing custom_id;
3. while a batch job runs, interactive streaming HTTP requests get their first tokens (TTFT compared with an idle
   server, and with the batch requests still waiting when each was sent) and the job still finishes;
4. the server killed mid-job -> `shuttle batch` exits non-zero (seconds measured) naming the endpoint; a rerun
   after the server is back completes the job.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/batch_acceptance.py [--lines 1000] [--interactive 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.server import ShuttleServer  # noqa: E402

CHAT = str(REPO / "tests" / "data" / "stories_chat.jinja")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int, batch_port: int) -> ShuttleServer:
    # ShuttleServer adds --port 0; the later --port wins, so a restarted server comes back on the same addresses
    return ShuttleServer("--chat-template", CHAT, "--port", str(port), "--batch-endpoint",
                         f"tcp://127.0.0.1:{batch_port}", "--max-waiting-requests", "4096")


def make_file(path: Path, n: int, max_tokens: int, long: range = range(0), long_tokens: int = 0) -> dict[str, dict]:
    """n lines; every 25th malformed (not JSON, or no custom_id), every 11th body invalid; the lines in `long` ask
    for `long_tokens` tokens (ignore_eos). Returns custom_id -> line."""
    lines, jobs = [], {}
    for i in range(n):
        if i % 25 == 24:
            lines.append("{truncated" if i % 50 == 24 else json.dumps({"url": "/v1/completions", "body": {}}))
            continue
        if i % 2:
            url, body = "/v1/completions", {"prompt": f"Once upon a time {i}", "max_tokens": max_tokens,
                                            "temperature": 0}
        else:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tom had {i} toys."}],
                                                 "max_tokens": max_tokens, "temperature": 0}
        if i in long:
            body.update(max_tokens=long_tokens, ignore_eos=True)
        if i % 11 == 10:
            body["max_tokens"] = -5
        line = {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}
        lines.append(json.dumps(line))
        jobs[line["custom_id"]] = line
    path.write_text("\n".join(lines) + "\n")
    return jobs


def http(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        return json.loads(response.read())


def shuttle_batch(inp: Path, out: Path, endpoint: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "batch", str(inp), str(out), "--endpoint", endpoint,
                             *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def wait_lines(out: Path, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (out.exists() and len(out.read_text().splitlines()) >= count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{out} did not reach {count} lines")
        time.sleep(0.05)


def acceptance_1(server: ShuttleServer, work: Path, n: int) -> None:
    inp, out = work / "a1.jsonl", work / "a1.out.jsonl"
    jobs = make_file(inp, n, 16)
    t0 = time.monotonic()
    done = shuttle_batch(inp, out, server.batch_endpoint)
    _, stderr = done.communicate(timeout=900)
    seconds = time.monotonic() - t0
    got = records(out)
    ids = [r["custom_id"] for r in got if r["custom_id"] is not None]
    statuses: dict[str, int] = {}
    same = 0
    for r in got:
        key = r["response"]["status_code"] if r["response"] else f"error:{r['error']['code']}"
        statuses[str(key)] = statuses.get(str(key), 0) + 1
    answered = [r for r in got if r["response"] is not None]

    def over_http(r: dict) -> tuple[int, dict]:
        return http(server.url, jobs[r["custom_id"]]["url"], jobs[r["custom_id"]]["body"])

    with ThreadPoolExecutor(16) as pool:  # every answered line against the same request over HTTP
        expectations = list(pool.map(over_http, answered))
    checked = len(answered)
    for r, (status, body) in zip(answered, expectations):
        if status != r["response"]["status_code"]:
            continue
        if status == 200:
            choice, expected = r["response"]["body"]["choices"][0], body["choices"][0]
            same += choice.get("text", choice.get("message")) == expected.get("text", expected.get("message"))
        else:
            same += body == r["response"]["body"]
    print(f"[1] {n} input lines -> {len(got)} output lines in {seconds:.1f} s (exit {done.returncode}); "
          f"{len(set(ids))} distinct custom_ids of {len(jobs)}, {len(got) - len(ids)} lines without one; "
          f"statuses {dict(sorted(statuses.items()))}; {same}/{checked} equal to the same request over HTTP "
          f"(greedy text, or the whole error body)")
    print("    progress (last line):", stderr.strip().splitlines()[-2][-160:] if stderr.strip() else "")


def acceptance_2(server: ShuttleServer, work: Path, n: int, long_tokens: int) -> None:
    inp, out = work / "a2.jsonl", work / "a2.out.jsonl"
    # the lines around the middle are long, so the jobs in flight at the kill would run for many seconds more
    jobs = make_file(inp, n, 16, range(int(n * 0.48), int(n * 0.56)), long_tokens)
    process = shuttle_batch(inp, out, server.batch_endpoint, "--max-in-flight", "64")
    wait_lines(out, int(n * 0.47))
    time.sleep(1.0)  # the long jobs are running
    in_flight = health(server.url)["in_flight"]
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed = time.monotonic()
    while health(server.url)["in_flight"] > 0:
        time.sleep(0.05)
    aborted_after = time.monotonic() - killed
    batch = health(server.url).get("batch", {})
    half = len(records(out))
    rerun = shuttle_batch(inp, out, server.batch_endpoint)
    rerun.communicate(timeout=900)
    got = records(out)
    ids = [r["custom_id"] for r in got if r["custom_id"] is not None]
    print(f"[2] killed -9 with {half}/{n} lines written and {in_flight} requests in flight; /health in_flight 0 "
          f"{aborted_after:.2f} s after the kill (batch stats {batch}); rerun exit {rerun.returncode}: {len(got)} lines, "
          f"{len(ids) - len(set(ids))} duplicate custom_ids, {len(set(jobs) - set(ids))} missing")


async def _interactive(url: str, index: int) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of one streamed completion."""
    import aiohttp
    body = {"prompt": f"Lily had a cat {index}", "max_tokens": 16, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    first = None
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {") and first is None:
                first = time.monotonic() - t0
    return first, time.monotonic() - t0


async def _interactive_wave(url: str, count: int, spacing: float) -> list[tuple[float, float, int]]:
    """`count` streamed requests `spacing` s apart; with each, the scheduler's waiting count when it was sent."""
    async def one(i: int):
        await asyncio.sleep(i * spacing)
        waiting = (await asyncio.to_thread(health, url))["scheduler"]["num_waiting"]
        ttft, total = await _interactive(url, i)
        return ttft, total, waiting
    return await asyncio.gather(*(one(i) for i in range(count)))


def acceptance_3(server: ShuttleServer, work: Path, n_batch: int, n_interactive: int) -> None:
    idle = asyncio.run(_interactive_wave(server.url, n_interactive, 0.05))
    inp, out = work / "a3.jsonl", work / "a3.out.jsonl"
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Once upon a time {i}", "max_tokens": 32, "temperature": 0, "ignore_eos": True}}
             for i in range(n_batch)]
    inp.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    process = shuttle_batch(inp, out, server.batch_endpoint, "--max-in-flight", str(n_batch), "--quiet")
    while health(server.url)["scheduler"]["num_waiting"] < 50:  # the batch job fills the queue
        time.sleep(0.05)
    busy = asyncio.run(_interactive_wave(server.url, n_interactive, 0.05))
    answered_at_end = len(out.read_text().splitlines()) if out.exists() else 0
    process.communicate(timeout=900)
    ok = sum(1 for r in records(out) if r["response"] and r["response"]["status_code"] == 200)

    def summary(wave):
        ttfts = sorted(w[0] * 1000 for w in wave)
        return f"TTFT median {ttfts[len(ttfts) // 2]:.0f} ms, max {ttfts[-1]:.0f} ms"
    waiting = [w[2] for w in busy]
    print(f"[3] {n_interactive} streamed requests on an idle server: {summary(idle)}; during a {n_batch}-request "
          f"batch job (batch requests waiting when each was sent: {min(waiting)}-{max(waiting)}): {summary(busy)}; "
          f"{answered_at_end} batch answers had arrived when the last interactive request ended; the job finished "
          f"with exit {process.returncode}, {ok}/{n_batch} answered 200")


def acceptance_4(server: ShuttleServer, work: Path, n: int, port: int, batch_port: int) -> ShuttleServer:
    inp, out = work / "a4.jsonl", work / "a4.out.jsonl"
    jobs = make_file(inp, n, 32)
    process = shuttle_batch(inp, out, server.batch_endpoint, "--max-in-flight", "32")
    wait_lines(out, n // 3)
    server.stop(signal.SIGKILL)
    stopped = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    exited_after = time.monotonic() - stopped
    partial = len(records(out))
    server = start(port, batch_port)
    rerun = shuttle_batch(inp, out, server.batch_endpoint)
    rerun.communicate(timeout=900)
    got = records(out)
    ids = [r["custom_id"] for r in got if r["custom_id"] is not None]
    print(f"[4] server killed with {partial}/{n} lines written: shuttle batch exited {process.returncode} "
          f"{exited_after:.1f} s later saying: {stderr.strip().splitlines()[-1]!r}")
    print(f"    rerun after restart: exit {rerun.returncode}, {len(got)} lines, "
          f"{len(ids) - len(set(ids))} duplicates, {len(set(jobs) - set(ids))} missing")
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=500, help="batch requests of acceptance 3")
    parser.add_argument("--interactive", type=int, default=20)
    parser.add_argument("--only", default="1,2,3,4", help="which acceptance items to measure")
    parser.add_argument("--long-tokens", type=int, default=200, help="tokens of the long jobs of acceptance 2")
    args = parser.parse_args()
    only = {int(x) for x in args.only.split(",")}
    port, batch_port = free_port(), free_port()
    server = start(port, batch_port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if 1 in only:
                acceptance_1(server, work, args.lines)
            if 2 in only:
                acceptance_2(server, work, args.lines, args.long_tokens)
            if 3 in only:
                acceptance_3(server, work, args.batch, args.interactive)
            if 4 in only:
                server = acceptance_4(server, work, args.lines, port, batch_port)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
