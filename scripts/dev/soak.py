#!/usr/bin/env python3
"""Soak test: many concurrent clients over loopback for a while, with faults, and an exact account of outcomes.

Clients (HTTP non-streamed, HTTP streamed, WebSocket, ZeroMQ batch, mixed by --mix) send short requests until
--duration seconds have passed or each has made --requests-per-client logical requests. A refusal (HTTP 503,
or a 503 error frame/result) is retried after its Retry-After, as a well-behaved client would; its "needed
wait" is the time from the refusal until the retry that was admitted. Some clients leave mid-request
(--disconnect), cancel (--cancel, WebSocket) or read slowly (--slow-reader). Optionally the worker is killed
(--kill-worker-every) or stopped (--stop-worker-every) at random times around that period.

Reported (a table on stdout, everything in --json): requests by outcome, lost requests (no terminal outcome:
a stream cut without an error event, a non-HTTP answer, a hang past --request-timeout), error counts by kind,
refusals with Retry-After against the needed wait, seconds the waiting queue sat empty while refused clients
still slept (Retry-After too long), KV blocks in use once idle (leaks), RSS of every process over time, TTFT and
ITL percentiles. Bounded in count and time; stops by itself.

    .venv/bin/python scripts/dev/soak.py --clients 1000 --duration 60 --kill-worker-every 20
    .venv/bin/python scripts/dev/soak.py --clients 10000 --requests-per-client 1 --rounds 2 --mix stream=5,http=4,ws=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import zmq
import zmq.asyncio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.common.messages import BatchHeartbeat, BatchPing, BatchRequest, BatchServerMessage  # noqa: E402
from shuttle.common.process import die_with_parent, raise_fd_limit  # noqa: E402

PROMPTS = ["Once upon a time", "Tom had a dog", "Lily saw a big", "The sun was", "A little bird", "Ben and Sue"]


@dataclass
class Stats:
    outcomes: Counter = field(default_factory=Counter)  # ok, error:<kind>, lost:<kind>, left, refused_gave_up
    refusals: list[tuple[str, float, float]] = field(default_factory=list)  # (cause, Retry-After, needed wait)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    sleeping_until: dict[int, float] = field(default_factory=dict)  # client -> end of its Retry-After sleep
    logical: int = 0
    lost_examples: dict[str, str] = field(default_factory=dict)


class Refused(Exception):
    def __init__(self, retry_after: float, message: str = ""):
        self.retry_after = retry_after
        # why: the waiting queue is full, the engine restarts, or the server drains
        self.cause = "engine_down" if "restart" in message or "engine stopped" in message else (
            "draining" if "shutting down" in message else "queue_full")


class Server:
    """`shuttle serve` started by the soak (its launcher dies with the soak), or an external one by URL."""

    def __init__(self, args):
        self.proc = None
        self.pids: dict[str, int] = {}
        self.restarts = 0
        self.url, self.batch = args.url, args.batch_endpoint
        if args.url:
            return
        cmd = [sys.executable, "-m", "shuttle.launcher.cli", "serve", args.model, "--port", "0",
               *args.server_args.split()]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=open(args.server_log, "w"),
                                     text=True, preexec_fn=die_with_parent)
        for line in self.proc.stdout:
            if line.startswith("shuttle: ready "):
                info = json.loads(line[len("shuttle: ready "):])
                self.url, self.batch, self.pids = info["url"], info["batch_endpoint"], info["pids"]
                self.pids["launcher"] = self.proc.pid
                break
        else:
            raise SystemExit(f"the server did not start; see {args.server_log}")
        asyncio.get_event_loop().run_in_executor(None, self._follow)

    def _follow(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("shuttle: restarted "):
                self.pids.update(json.loads(line[len("shuttle: restarted "):])["pids"])
                self.restarts += 1

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def rss_mib(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": values[-1]}


class Soak:
    def __init__(self, args, server: Server, stats: Stats):
        self.args, self.server, self.stats = args, server, stats
        self.rng = random.Random(args.seed)
        kinds, weights = zip(*[(k, float(w)) for k, w in (p.split("=") for p in args.mix.split(","))])
        self.kinds, self.weights = kinds, weights
        self.deadline = 0.0
        self.zctx = zmq.asyncio.Context.instance()
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def body(self, stream: bool = False) -> dict:
        return {"prompt": self.rng.choice(PROMPTS), "max_tokens": self.rng.randint(1, self.args.max_tokens),
                "temperature": 0.8, "stream": stream}

    async def client(self, cid: int, session: aiohttp.ClientSession) -> None:
        made = 0
        while time.monotonic() < self.deadline and made < self.args.requests_per_client:
            if self.stats.logical >= self.args.max_requests:
                return
            self.stats.logical += 1
            made += 1
            kind = self.rng.choices(self.kinds, self.weights)[0]
            await self.logical_request(cid, kind, session)

    async def logical_request(self, cid: int, kind: str, session) -> None:
        """One request, retried after each refusal until admitted or out of time."""
        chain: list[tuple[float, float]] = []
        while True:
            sent = time.monotonic()
            try:
                outcome = await asyncio.wait_for(self.attempt(kind, session), self.args.request_timeout)
            except Refused as refusal:
                chain.append((time.monotonic(), refusal.retry_after, refusal.cause))
                if time.monotonic() + refusal.retry_after > self.deadline + self.args.retry_grace:
                    self.stats.outcomes["refused_gave_up"] += 1
                    return
                self.stats.sleeping_until[cid] = time.monotonic() + refusal.retry_after
                await asyncio.sleep(refusal.retry_after)
                self.stats.sleeping_until.pop(cid, None)
                continue
            except asyncio.TimeoutError:
                outcome = f"lost:{kind}_timeout"
            except (aiohttp.ClientError, ConnectionError) as exc:
                outcome = f"lost:{kind}_{type(exc).__name__}"
                self.stats.lost_examples.setdefault(outcome, str(exc)[:160])
            for refused_at, retry_after, cause in chain:
                self.stats.refusals.append((cause, retry_after, sent - refused_at))
            self.stats.outcomes[outcome] += 1
            return

    async def attempt(self, kind: str, session) -> str:
        leave = self.rng.random() < self.args.disconnect
        if kind == "http":
            return await self.http(session, leave)
        if kind == "stream":
            return await self.stream(session, leave, slow=self.rng.random() < self.args.slow_reader)
        if kind == "ws":
            return await self.websocket(session, leave, cancel=self.rng.random() < self.args.cancel)
        return await self.batch_job()

    async def http(self, session, leave: bool) -> str:
        request = session.post(f"{self.server.url}/v1/completions", json=self.body())
        if leave:  # give up after a moment, mid-request
            task = asyncio.ensure_future(request)
            await asyncio.sleep(self.rng.uniform(0, 0.2))
            if not task.done():
                task.cancel()
                return "left"
            response = task.result()
        else:
            response = await request
        async with response:
            if response.status == 503:
                body = await response.json()
                raise Refused(float(response.headers.get("Retry-After", 1)), body["error"]["message"])
            body = await response.json()
            if response.status == 200:
                return "ok"
            return f"error:http_{response.status}" if "error" in body else f"lost:http_{response.status}"

    async def stream(self, session, leave: bool, slow: bool) -> str:
        started = time.monotonic()
        async with session.post(f"{self.server.url}/v1/completions", json=self.body(stream=True)) as response:
            if response.status == 503:
                body = await response.json()
                raise Refused(float(response.headers.get("Retry-After", 1)), body["error"]["message"])
            if response.status != 200:
                await response.read()
                return f"error:stream_{response.status}"
            last, finished = None, None
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                now = time.monotonic()
                data = line[6:].strip()
                if data == b"[DONE]":
                    return finished or "lost:stream_done_without_end"
                event = json.loads(data)
                if "error" in event:
                    finished = f"error:stream_{event['error']['code']}"
                    continue
                if last is None:
                    self.stats.ttft.append(now - started)
                else:
                    self.stats.itl.append(now - last)
                last = now
                if event["choices"][0]["finish_reason"] is not None:
                    finished = "ok"
                if leave:
                    return "left"  # closing the response mid-stream
                if slow:
                    await asyncio.sleep(0.2)
            return "lost:stream_cut"  # the connection ended without [DONE]

    async def websocket(self, session, leave: bool, cancel: bool) -> str:
        started = time.monotonic()
        async with session.ws_connect(f"{self.server.url.replace('http', 'ws', 1)}/v1/ws") as ws:
            await ws.send_json({"type": "generate", "id": "g", **{k: v for k, v in self.body().items()
                                                                   if k != "stream"}})
            last = None
            while True:
                message = await ws.receive()
                if message.type != aiohttp.WSMsgType.TEXT:
                    return "lost:ws_closed"
                frame = json.loads(message.data)
                now = time.monotonic()
                if frame["type"] == "delta":
                    (self.stats.ttft if last is None else self.stats.itl).append(now - (last or started))
                    last = now
                    if leave:
                        return "left"
                    if cancel:
                        await ws.send_json({"type": "cancel", "id": "g"})
                        cancel = False
                elif frame["type"] == "done":
                    return "ok" if frame["finish_reason"] != "abort" else "cancelled"
                else:
                    code = frame["error"]["code"]
                    if code == 503 and last is None and "shutting down" not in frame["error"]["message"]:
                        raise Refused(float(frame.get("retry_after") or 1), frame["error"]["message"])
                    return f"error:ws_{code}"

    async def batch_job(self) -> str:
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.batch)
        try:
            body = self.body()
            job = BatchRequest(job_id="j", url="/v1/completions", body={"prompt": body["prompt"],
                                                                        "max_tokens": body["max_tokens"],
                                                         "temperature": 0.8}, api_key=self.args.api_key or "")
            await sock.send(msgspec.msgpack.encode(job))
            ping = msgspec.msgpack.encode(BatchPing())
            while True:  # a client that stays silent for a few seconds is taken as gone: ping while waiting
                if await sock.poll(1000) and not isinstance(
                        result := msgspec.msgpack.decode(await sock.recv(), type=BatchServerMessage), BatchHeartbeat):
                    break
                await sock.send(ping)
        finally:
            sock.close()
        if result.status_code == 503:
            raise Refused(result.retry_after or 1.0, result.body["error"]["message"])
        return "ok" if result.status_code == 200 else f"error:batch_{result.status_code}"

async def faults(args, server: Server, stop: asyncio.Event, log: list, soak: "Soak") -> None:
    """Kill -9 or SIGSTOP the worker at random times around the configured period, until the round's deadline
    (the tail, where refused clients finish, runs without faults)."""
    rng = random.Random(args.seed + 1)
    period = args.kill_worker_every or args.stop_worker_every
    if not period or server.proc is None:
        return
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(0.5, 1.5) * period)
            return
        except asyncio.TimeoutError:
            pass
        if time.monotonic() > soak.deadline:
            continue
        pid = server.pids.get("worker")
        sig = signal.SIGKILL if args.kill_worker_every else signal.SIGSTOP
        try:
            os.kill(pid, sig)
            log.append({"t": time.monotonic(), "signal": sig.name, "pid": pid})
        except (ProcessLookupError, TypeError):
            pass


async def sample(args, server: Server, session, stop: asyncio.Event, rss: dict, idle: list, stats: Stats) -> None:
    """RSS of every process and the waiting queue, every --rss-interval seconds."""
    start = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        for name, pid in server.pids.items():
            value = rss_mib(pid)
            if value is not None:
                rss[name].append((round(now - start, 1), round(value, 1)))
        try:
            async with session.get(f"{server.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as response:
                health = await response.json()
            waiting = health["scheduler"]["num_waiting"]
            sleepers = sum(1 for until in stats.sleeping_until.values() if until > now)
            if response.status == 200 and waiting == 0 and sleepers:
                idle.append(now)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), args.rss_interval)
        except asyncio.TimeoutError:
            pass


async def idle_health(server: Server, session, within: float) -> dict:
    """/health once nothing runs or waits (up to `within` seconds: a silent frontend's requests are reaped)."""
    deadline = time.monotonic() + within
    health = {}
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{server.url}/health") as response:
                health = await response.json()
            stats = health["scheduler"]
            if response.status == 200 and stats["num_running"] == stats["num_waiting"] == 0 and \
                    stats["num_blocks_in_use"] == 0:
                return health
        except (aiohttp.ClientError, ValueError):
            pass
        await asyncio.sleep(0.5)
    return health


async def run(args) -> dict:
    server = Server(args)
    stats = Stats()
    soak = Soak(args, server, stats)
    rss: dict[str, list] = defaultdict(list)
    idle: list[float] = []
    fault_log: list = []
    # a new connection per request: a reused keep-alive connection that the server closes as idle just as a request
    # goes out on it loses that request in any HTTP/1.1 client; that race is not what this soak measures
    connector = aiohttp.TCPConnector(limit=0, force_close=not args.keep_alive)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    rounds = []
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=soak.headers) as session, \
            aiohttp.ClientSession(headers=soak.headers) as probe:
        stop = asyncio.Event()
        samplers = [asyncio.create_task(sample(args, server, probe, stop, rss, idle, stats)),
                    asyncio.create_task(faults(args, server, stop, fault_log, soak))]
        for round_index in range(args.rounds):
            soak.deadline = time.monotonic() + args.duration
            begun = time.monotonic()
            stats.refusals, idle[:] = [], []
            await asyncio.gather(*(soak.client(c, session) for c in range(args.clients)))
            health = await idle_health(server, probe, 60)
            rounds.append({"round": round_index, "seconds": round(time.monotonic() - begun, 1),
                           "frontend_rss_mib": rss_mib(server.pids.get("frontend", -1)),
                           "blocks_in_use_when_idle": health.get("scheduler", {}).get("num_blocks_in_use"),
                           "refusals": refusal_summary(stats.refusals, len(idle) * args.rss_interval)})
        stop.set()
        await asyncio.gather(*samplers)
        final = await idle_health(server, probe, 60)
    exit_status = server.stop()
    lost = sum(n for k, n in stats.outcomes.items() if k.startswith("lost:"))
    errors = {k[6:]: n for k, n in stats.outcomes.items() if k.startswith("error:")}
    return {
        "config": vars(args), "seconds": round(time.monotonic() - started, 1), "logical_requests": stats.logical,
        "outcomes": dict(stats.outcomes), "lost": lost, "lost_examples": stats.lost_examples, "errors_by_kind": errors,
        "refusals": rounds[-1]["refusals"],  # the last round's: earlier ones are warm-up
        "blocks_in_use_when_idle": final.get("scheduler", {}).get("num_blocks_in_use"),
        "final_health": final, "rounds": rounds, "restarts": server.restarts, "faults": len(fault_log),
        "ttft_s": percentiles(stats.ttft), "itl_s": percentiles(stats.itl), "rss_mib": dict(rss),
        "server_exit_status": exit_status,
    }


def refusal_summary(refusals: list[tuple[str, float, float]], idle_s: float) -> dict:
    """Each refusal's needed wait over its Retry-After, overall and by cause."""
    ratios = [needed / retry_after for _, retry_after, needed in refusals if retry_after > 0]
    by_cause = {}
    for cause in sorted({c for c, _, _ in refusals}):
        mine = [(r, n) for c, r, n in refusals if c == cause]
        by_cause[cause] = {"count": len(mine), "within_2x": sum(1 for r, n in mine if r > 0 and 0.5 <= n / r <= 2),
                           "needed_over_retry_after": percentiles([n / r for r, n in mine if r > 0]),
                           "retry_after_s": percentiles([r for r, _ in mine])}
    return {"count": len(refusals), "within_2x": sum(1 for r in ratios if 0.5 <= r <= 2.0),
            "needed_over_retry_after": percentiles(ratios), "retry_after_s": percentiles([r for _, r, _ in refusals]),
            "by_cause": by_cause, "queue_empty_while_clients_slept_s": round(idle_s, 1)}


def table(report: dict) -> str:
    out = [f"{'logical requests':34}{report['logical_requests']:>10}   in {report['seconds']} s"]
    for name, count in sorted(report["outcomes"].items()):
        out.append(f"  {name:32}{count:>10}")
    out.append(f"{'lost (no terminal outcome)':34}{report['lost']:>10}")
    out.append(f"{'KV blocks in use when idle':34}{report['blocks_in_use_when_idle']!s:>10}")
    out.append(f"{'worker faults injected':34}{report['faults']:>10}   engine restarts {report['restarts']}")
    r = report["refusals"]
    out.append(f"{'refusals, last round':34}{r['count']:>10}   within 2x of needed wait: {r['within_2x']}")
    for cause, c in r["by_cause"].items():
        out.append(f"  {cause:32}{c['count']:>10}   within 2x: {c['within_2x']}")
        for name in ("needed_over_retry_after", "retry_after_s"):
            p = c[name]
            if p:
                out.append(f"    {name:30}p50 {p['p50']:.2f}  p90 {p['p90']:.2f}  p99 {p['p99']:.2f}"
                           f"  max {p['max']:.2f}")
    out.append(f"  {'queue empty while clients slept':32}{r['queue_empty_while_clients_slept_s']:>10} s")
    for name in ("ttft_s", "itl_s"):
        p = report[name]
        if p:
            out.append(f"{name:34}p50 {p['p50']:.3f}  p90 {p['p90']:.3f}  p99 {p['p99']:.3f}  max {p['max']:.3f}  "
                       f"(n={p['n']})")
    for rnd in report["rounds"]:
        out.append(f"round {rnd['round']}: {rnd['seconds']} s, frontend RSS {rnd['frontend_rss_mib']} MiB, "
                   f"blocks in use when idle {rnd['blocks_in_use_when_idle']}, refusals {rnd['refusals']['count']} "
                   f"({rnd['refusals']['within_2x']} within 2x)")
    for name, series in report["rss_mib"].items():
        if series:
            values = [v for _, v in series]
            out.append(f"RSS {name:10} MiB  start {values[0]:.1f}  max {max(values):.1f}  end {values[-1]:.1f}")
    out.append(f"server exit status {report['server_exit_status']}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", help="an external server (default: start one)")
    p.add_argument("--batch-endpoint", default="tcp://127.0.0.1:8001", help="with --url")
    p.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    p.add_argument("--server-args", default="", help="extra `shuttle serve` flags for the started server")
    p.add_argument("--server-log", default="/tmp/shuttle-soak-server.log")
    p.add_argument("--api-key", default=os.environ.get("SHUTTLE_API_KEY"))
    p.add_argument("--clients", type=int, default=100, help="concurrent clients (one connection each)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds each round admits new requests")
    p.add_argument("--rounds", type=int, default=1, help="rounds; the first is the warm-up for the RSS comparison")
    p.add_argument("--requests-per-client", type=int, default=10**9, help="logical requests per client per round")
    p.add_argument("--max-requests", type=int, default=10**7, help="logical requests in all, at most")
    p.add_argument("--request-timeout", type=float, default=300.0, help="client-side: longer counts as lost")
    p.add_argument("--retry-grace", type=float, default=600.0, help="refused clients retry until deadline + this")
    p.add_argument("--mix", default="http=3,stream=4,ws=2,batch=1", help="kind=weight, of http, stream, ws, batch")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.1, help="share of requests whose client leaves midway")
    p.add_argument("--cancel", type=float, default=0.05, help="share of WebSocket generations cancelled midway")
    p.add_argument("--slow-reader", type=float, default=0.05, help="share of streams read slowly")
    p.add_argument("--kill-worker-every", type=float, default=0.0, help="seconds, roughly, between kill -9s")
    p.add_argument("--stop-worker-every", type=float, default=0.0, help="seconds, roughly, between SIGSTOPs")
    p.add_argument("--keep-alive", action="store_true", help="reuse HTTP connections between a client's requests")
    p.add_argument("--rss-interval", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="soak.json", help="where to write the full report")
    args = p.parse_args()
    raise_fd_limit()
    report = asyncio.run(run(args))
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(table(report))
    for kind, example in report["lost_examples"].items():
        print(f"  e.g. {kind}: {example}")
    print(f"full report: {args.json}")
    return 0 if report["lost"] == 0 and report["blocks_in_use_when_idle"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
