#!/usr/bin/env python3
"""Does Retry-After tell the truth? N concurrent streams against a real server whose waiting queue fills.

Starts `shuttle serve` (launcher/local_server.py's ShuttleServer, stopped by PID however the run ends), then fires
--num-requests streaming completions at once over loopback (aiohttp, one connection each). A refused client
(HTTP 503) sleeps exactly what it was told (`retry-after-ms` when sent, else `Retry-After`, as the official openai
client reads them) and tries again, at most --max-attempts times. Meanwhile /health is sampled every
--health-interval seconds for the waiting queue (num_waiting) and the running set.

Per refusal:
- told: the wait the 503 asked for.
- actual: from the refusal until the client's request was admitted (the headers of a 200 arrive, which the
  server sends with the first token): what honouring the promise cost it, refusals of its retries included.
- needed: from the refusal until the first /health sample at which the waiting queue had room for this client
  and for every client refused before it that was still asleep (free slots >= those sleepers + 1): the wait it
  needed had it been told the truth and everyone ahead of it had come back at once: when a retry would no longer
  have been refused, which is what Retry-After promises. At least one sample interval. A queue that frees slots in
  lumps (requests of one length, started together, finish together) makes it shorter than an evenly paced line.
Reported: p50, p90, max of told, actual, needed, told/needed (above 1: the promise was too long) and
told/actual; refusals per request; the seconds the waiting queue sat empty while refused clients slept
(promises too long), the rate at which requests left the waiting queue meanwhile and the rate at which retries
came; the run's duration. With --restarts K, the worker is then killed K times (SIGKILL, by PID, each once the
engine serves again) and one client honouring Retry-After measures the restart estimate against the time until
/health says ok again (needed) and until it got in (actual); with --drain, the launcher gets SIGTERM while a
few long streams run and a new request's 503 headers are shown, and when the server exited.
No assertions: it prints a table and writes JSON.

    .venv/bin/python scripts/dev/bench_retry_after.py                       # 10,000 streams, the server's defaults
    .venv/bin/python scripts/dev/bench_retry_after.py --num-requests 2000 --max-waiting-requests 256 --restarts 2 \\
        --drain
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.common.process import raise_fd_limit  # noqa: E402
from shuttle.launcher.local_server import ShuttleServer  # noqa: E402

PROMPTS = ["Once upon a time", "Tom had a dog", "Lily saw a big", "The sun was", "A little bird", "Ben and Sue"]


@dataclass
class Refusal:
    client: int
    at: float  # monotonic time the 503 arrived
    told: float | None  # seconds; None: no promise (the server is going away)
    message: str
    woke: float = 0.0  # when the next attempt was sent (0: none)
    admitted: float = 0.0  # when the client's request was finally admitted (0: never)


@dataclass
class Run:
    refusals: list[Refusal] = field(default_factory=list)
    asleep: dict[int, Refusal] = field(default_factory=dict)  # client -> its refusal while it sleeps
    # (t, num_waiting, num_running, clients asleep, num_admitted: requests that ever left the waiting queue)
    samples: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    attempts: list[int] = field(default_factory=list)  # per admitted request

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def told_seconds(headers) -> float | None:
    """The wait a 503 asks for, read as the openai client reads it: retry-after-ms first, then Retry-After."""
    for name, divisor in (("retry-after-ms", 1000.0), ("Retry-After", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return float(value) / divisor
            except ValueError:
                continue
    return None


async def one_client(run: Run, session: aiohttp.ClientSession, url: str, client: int, args) -> None:
    body = {"prompt": PROMPTS[client % len(PROMPTS)], "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chain: list[Refusal] = []
    for attempt in range(1, args.max_attempts + 1):
        if chain:
            chain[-1].woke = time.monotonic()
        run.asleep.pop(client, None)
        try:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                if response.status == 503:
                    told = told_seconds(response.headers)
                    message = (await response.json())["error"]["message"]
                    refusal = Refusal(client, time.monotonic(), told, message)
                    run.refusals.append(refusal)
                    chain.append(refusal)
                    if told is None:
                        run.count("refused without a promise")
                        return
                    run.asleep[client] = refusal
                    await asyncio.sleep(told)
                    continue
                if response.status != 200:
                    run.count(f"http {response.status}")
                    return
                admitted = time.monotonic()
                for refusal in chain:
                    refusal.admitted = admitted
                async for _ in response.content.iter_any():
                    pass
                run.count("completed")
                run.attempts.append(attempt)
                return
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            run.count(f"error {type(exc).__name__}")
            return
    run.count("gave up")


async def sample(run: Run, url: str, interval: float, stop: asyncio.Event) -> None:
    """The waiting queue and running set from /health every `interval` seconds (stamped when the answer came)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while not stop.is_set():
            try:
                async with session.get(f"{url}/health") as response:
                    scheduler = (await response.json())["scheduler"]
                run.samples.append((time.monotonic(), scheduler["num_waiting"], scheduler["num_running"],
                                    len(run.asleep), scheduler["num_admitted"]))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass


def needed_waits(run: Run, max_waiting: int, interval: float) -> list[float | None]:
    """Per refusal (in run.refusals' order): the `needed` wait of the module docstring; None if never met."""
    # clients asleep at each sample, as the sorted refusal times of their current refusal
    asleep_at = []
    for t, *_ in run.samples:
        asleep_at.append(sorted(r.at for r in run.refusals if r.at <= t < (r.woke or float("inf"))))
    sample_times = [s[0] for s in run.samples]
    needed: list[float | None] = []
    for refusal in run.refusals:
        result = None
        for k in range(bisect.bisect_right(sample_times, refusal.at), len(run.samples)):
            t, waiting = run.samples[k][0], run.samples[k][1]
            ahead = bisect.bisect_left(asleep_at[k], refusal.at)
            if max_waiting - waiting >= ahead + 1:
                result = max(t - refusal.at, interval)
                break
        needed.append(result)
    return needed


def idle_seconds(run: Run) -> tuple[float, float, float | None]:
    """Seconds the waiting queue sat empty while refused clients slept, seconds with clients asleep at all, and
    requests leaving the waiting queue per second meanwhile (None: no such time)."""
    empty = asleep = 0.0
    admitted = 0
    for (t0, waiting, _, sleepers, n0), (t1, *_, n1) in zip(run.samples, run.samples[1:]):
        if sleepers:
            asleep += t1 - t0
            admitted += max(n1 - n0, 0)
            if waiting == 0:
                empty += t1 - t0
    return empty, asleep, admitted / asleep if asleep else None


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "p50": round(pick(0.5), 3), "p90": round(pick(0.9), 3), "max": round(values[-1], 3)}


async def burst(url: str, args) -> tuple[Run, float]:
    run = Run()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(run, url, args.health_interval, stop))
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per attempt, as many at once
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    start = time.monotonic()
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(one_client(run, session, url, i, args) for i in range(args.num_requests)))
    finally:
        duration = time.monotonic() - start
        stop.set()
        await sampler
    return run, duration


async def restart_check(server: ShuttleServer, args) -> dict:
    """Kill the worker; one client honours Retry-After until admitted. needed: refusal -> /health ok again."""
    url = server.url
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    refusals: list[tuple[float, float | None]] = []
    went = back = admitted = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async def health() -> int:
            try:
                async with session.get(f"{url}/health") as response:
                    return response.status
            except aiohttp.ClientError:
                return 0

        worker = server.pids["worker"]
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        while await health() == 200 and time.monotonic() - killed < args.restart_timeout:
            await asyncio.sleep(0.02)  # until the launcher has told the frontend
        went = time.monotonic()

        async def watch() -> None:
            nonlocal back
            while time.monotonic() - killed < args.restart_timeout:
                if await health() == 200:
                    back = time.monotonic()
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        for _ in range(args.max_attempts):
            async with session.post(f"{url}/v1/completions", json=body) as response:
                if response.status == 200:
                    admitted = time.monotonic()
                    break
                told = told_seconds(response.headers)
                refusals.append((time.monotonic(), told))
                if told is None:
                    break
                await asyncio.sleep(told)
        await watcher
        while server.pids["worker"] == worker and time.monotonic() - killed < args.restart_timeout:
            await asyncio.sleep(0.05)  # the launcher's "restarted" line names the new worker
    rows = [{"told": told, "needed": round(back - at, 3) if back else None,
             "actual": round(admitted - at, 3) if admitted else None} for at, told in refusals]
    return {"down_after_s": round(went - killed, 3), "back_after_s": round(back - killed, 3) if back else None,
            "refusals": rows}


async def drain_check(server: ShuttleServer, args) -> dict:
    """SIGTERM while long streams run; the headers of a new request's 503, and when the server exited."""
    url = server.url
    long_body = {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def long_stream() -> None:
            try:
                async with session.post(f"{url}/v1/completions", json=long_body) as response:
                    async for _ in response.content.iter_any():
                        pass
            except aiohttp.ClientError:
                pass

        streams = [asyncio.create_task(long_stream()) for _ in range(8)]
        await asyncio.sleep(1.0)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        try:
            async with session.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2}) as response:
                answer = {"status": response.status, **{h: response.headers.get(h) for h in
                                                        ("Retry-After", "retry-after-ms", "Connection",
                                                         "x-should-retry")}}
        except aiohttp.ClientError as exc:
            answer = {"error": type(exc).__name__}
        await asyncio.gather(*streams)
    exited = await asyncio.to_thread(server.proc.wait, 60)
    return {"answer": answer, "server_exited_after_s": round(time.monotonic() - signalled, 1), "exit": exited}


def report(run: Run, duration: float, args) -> dict:
    needed = needed_waits(run, args.max_waiting_requests, args.health_interval)
    promised = [(r, n) for r, n in zip(run.refusals, needed) if r.told is not None]
    told = [r.told for r, _ in promised]
    actual = [r.admitted - r.at for r, _ in promised if r.admitted]
    met = [(r, n) for r, n in promised if n is not None]
    empty, asleep, admission_rate = idle_seconds(run)
    retries = sorted(r.woke for r in run.refusals if r.woke)
    requests_refused = len({r.client for r in run.refusals})
    return {
        "num_requests": args.num_requests, "duration_s": round(duration, 1), "outcomes": run.outcomes,
        "requests_refused": requests_refused, "refusals": len(run.refusals),
        "refusals_per_refused_request": percentiles([float(a - 1) for a in run.attempts if a > 1]),
        "told_s": percentiles(told), "actual_s": percentiles(actual),
        "needed_s": percentiles([n for _, n in met]), "needed_never_met": len(promised) - len(met),
        "told_over_needed": percentiles([r.told / n for r, n in met]),
        "told_over_actual": percentiles([r.told / (r.admitted - r.at) for r, _ in promised
                                         if r.admitted and r.admitted > r.at]),
        "queue_empty_while_clients_slept_s": round(empty, 1), "clients_asleep_s": round(asleep, 1),
        "admitted_per_s_while_clients_slept": round(admission_rate, 1) if admission_rate else None,
        "retries_per_s": round((len(retries) - 1) / (retries[-1] - retries[0]), 1) if len(retries) > 1 else None,
        "samples": len(run.samples),
    }


def table(result: dict) -> str:
    lines = [f"{result['num_requests']} streams in {result['duration_s']} s; outcomes {result['outcomes']}",
             f"refused requests {result['requests_refused']}, refusals {result['refusals']}, "
             f"refusals per refused request {result['refusals_per_refused_request']}",
             f"{'':18}{'n':>7}{'p50':>9}{'p90':>9}{'max':>9}"]
    for name in ("told_s", "actual_s", "needed_s", "told_over_needed", "told_over_actual"):
        p = result[name]
        cells = "".join(f"{p.get(q, float('nan')):>9.2f}" for q in ("p50", "p90", "max"))
        lines.append(f"{name:18}{p['n']:>7}{cells}")
    lines.append(f"needed never met: {result['needed_never_met']}; waiting queue empty while clients slept: "
                 f"{result['queue_empty_while_clients_slept_s']} s of {result['clients_asleep_s']} s with clients "
                 f"asleep")
    lines.append(f"requests leaving the waiting queue per second while clients slept: "
                 f"{result['admitted_per_s_while_clients_slept']}; retries sent per second: {result['retries_per_s']}")
    for i, restart in enumerate(result.get("restarts", [])):
        lines.append(f"restart {i + 1}: {json.dumps(restart)}")
    if "drain" in result:
        lines.append(f"drain: {json.dumps(result['drain'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-waiting-requests", type=int, default=4096, help="the server's flag (its default)")
    parser.add_argument("--server-arg", action="append", default=[], help="more `shuttle serve` arguments")
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds the worker sleeps per step (SHUTTLE_DEBUG_STEP_DELAY)")
    parser.add_argument("--max-attempts", type=int, default=100)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one attempt may take")
    parser.add_argument("--health-interval", type=float, default=0.1)
    parser.add_argument("--restarts", type=int, default=0,
                        help="then kill the worker this many times, one after the other, checking the restart estimate")
    parser.add_argument("--restart-timeout", type=float, default=120.0)
    parser.add_argument("--drain", action="store_true", help="then SIGTERM the server and show a 503's headers")
    parser.add_argument("--json", default="bench_retry_after.json")
    args = parser.parse_args()
    raise_fd_limit()  # one socket per client; the server's processes inherit the raised limit
    server = ShuttleServer("--max-waiting-requests", str(args.max_waiting_requests), *args.server_arg,
                           step_delay=args.step_delay)
    try:
        run, duration = asyncio.run(burst(server.url, args))
        result = report(run, duration, args)
        result["command"] = sys.argv
        # the first restart is predicted from the first start-up, the next from the restart measured before it
        result["restarts"] = [asyncio.run(restart_check(server, args)) for _ in range(args.restarts)]
        if args.drain:
            result["drain"] = asyncio.run(drain_check(server, args))
    finally:
        server.stop()
    print(table(result))
    result["refusal_log"] = [asdict(r) for r in run.refusals[:20000]]
    result["health_samples"] = run.samples
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
