"""A discrete-event simulator of one serving group that drives the real Scheduler (scheduler/scheduler.py) with a
virtual clock and a step-cost model instead of a worker.

The processes are lanes of CPU work on the machine's cores (capacity/shared_cores.py): the worker runs each step
(StepCostModel.worker_seconds of its shape, times the jitter), the scheduler plans and settles (scheduler_s per
step, half each), the frontend takes each request in (ingress_s: HTTP, tokenization, submit) and streams each
step's outputs (egress_step_s, then egress_s per token), and the benchmark client reads them (client_cpu_*; a
busy client reads what waits in a stream's socket at once: outputs that reach a stream whose read has not started
join it, and their tokens arrive together, as bench_serve.py's reads do); client_s is added to every token a client
sees. With cost.cores 0 each process has a core of its own; with cores
they share them, so a step runs slower while the frontend and the client stream the step before, and near
saturation everything queues for the cores as on the machine.

The scheduler has the overlapped loop's semantics (scheduler/loop.py): with async scheduling up to two plans are in
flight, step N+1 is planned as soon as step N was sent, the worker runs plans in order, and the scheduler settles a
step when its result is back and it is free, taking in requests whenever the frontend hands them over (of requests
sent together the first is planned alone, as a real server does). Sampled tokens are fabricated (never an
end-of-sequence id: outputs have their workload length, as with bench_serve.py's ignore_eos), so everything else
(chunked prefill, KV blocks, prefix cache, preemption, admission, SLO refusals) is the real code's behaviour.

The machine's speed follows cost.speed_trace (capacity/machine_speed.py), when the profile has one: every process's
work runs slower in its slow spells, as on a shared host.

Deterministic: the same workload, configuration, cost model and seed give the same result, bit for bit (the
seed drives the optional step-time jitter of the cost model and where the speed trace starts).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from common.config import SchedulerConfig
from common.messages import FinishReason, StepResult, Submit
from common.sampling import SamplingParams
from common.step_cost import StepCostModel, StepShape, shape_of
from capacity.shared_cores import SharedCores
from capacity.workload import SimRequest
from scheduler.admission import SloAdmission
from scheduler.kv_cache import KVCacheManager
from scheduler.scheduled_step import ScheduledStep
from scheduler.scheduler import Scheduler

CLIENT = b"sim"
FILLER_TOKEN = 5  # the fabricated sampled token; never an end-of-sequence id in the simulation
IDLE_POLL_S = 0.1  # scheduler/loop.py's IDLE_POLL_MS: how long a stuck scheduler waits for news


@dataclass(slots=True)
class RequestRecord:
    """What one request experienced (seconds from the start of the simulation).

    Attributes:
        arrival: when the client sent it.
        token_times: when each output token reached the client.
        status: 0 when it finished; else the HTTP status of its error (503 refused, ...).
        retry_after_s: with a refusal, the Retry-After the client was given.
        finish: when its last token (or its error) reached the client.
    """

    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    status: int = 0
    retry_after_s: float = 0.0
    finish: float = math.nan

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]


@dataclass
class Sample:
    """The scheduler's state when a step was planned (for queue length / KV usage over time)."""

    time: float
    num_waiting: int
    num_running: int
    kv_usage: float  # blocks in use / total
    num_tokens: int  # scheduled in the step


@dataclass(slots=True)
class ServedSeconds:
    """A simulated step as scheduler/step_log.py logs a real one: its shape and seconds from when the worker could
    start it (sent, and the step before it done) to its result."""

    shape: StepShape
    seconds: float


@dataclass(slots=True)
class _Flight:
    """A planned step until it is settled."""

    step: ScheduledStep
    result_back: bool = False
    sent_at: float = math.nan  # when the scheduler handed it to the worker


@dataclass
class SimResult:
    records: list[RequestRecord]
    samples: list[Sample]
    num_steps: int  # steps the worker ran
    num_preemptions: int
    duration: float  # first arrival to last finish, seconds
    served: list[ServedSeconds] = field(default_factory=list)  # each step as the server's --step-log has it

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.status == 0 and r.token_times]

    def summary(self, ttft_slo_ms: float | None = None, itl_slo_ms: float | None = None) -> dict:
        """bench_serve.py's summary keys: counts, throughput, goodput and mean/median/p90/p99 in ms of TTFT,
        TPOT, ITL and e2e (nearest-rank percentiles, as bench_serve computes them). Goodput counts, as
        bench_serve's does, requests whose TTFT and mean inter-token time (TPOT) are within the objectives."""
        done = self.completed
        duration = max(self.duration, 1e-9)
        tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in done
                 if len(r.token_times) > 1]
        good = [r for r in done if (ttft_slo_ms is None or 1000 * r.ttft <= ttft_slo_ms)
                and (itl_slo_ms is None or len(r.token_times) < 2
                     or 1000 * (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) <= itl_slo_ms)]
        return {
            "completed": len(done), "refused": sum(r.status == 503 for r in self.records),
            "failed": sum(r.status not in (0, 503) for r in self.records),
            "duration_s": duration, "request_throughput": len(done) / duration,
            "output_token_throughput": sum(len(r.token_times) for r in done) / duration,
            "input_token_throughput": sum(r.prompt_len for r in done) / duration,
            "goodput": len(good) / duration if (ttft_slo_ms or itl_slo_ms) else None,
            "ttft_ms": percentiles([r.ttft for r in done]), "tpot_ms": percentiles(tpots),
            "itl_ms": percentiles([x for r in done for x in r.itls]),
            "e2e_ms": percentiles([r.token_times[-1] - r.arrival for r in done]),
            "num_steps": self.num_steps, "num_preemptions": self.num_preemptions,
            "max_waiting": max((s.num_waiting for s in self.samples), default=0),
            "max_kv_usage": max((s.kv_usage for s in self.samples), default=0.0),
        }


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds of values in seconds (bench_serve.py's nearest-rank rule)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)
    n = len(ordered)

    def rank(p: float) -> float:
        return ordered[min(n - 1, max(0, int(round(p / 100 * n + 0.5)) - 1))]

    middle = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"mean": 1000 * sum(ordered) / n, "median": 1000 * middle, "p90": 1000 * rank(90),
            "p99": 1000 * rank(99)}


class _MachineSpeed:
    """The machine's speed during a run: cost.speed_trace replayed from `start` or a point the seed draws
    (wrapping around), one value per interval; constant 1 without a trace."""

    def __init__(self, trace: list[float], interval_s: float, rng: random.Random, start: int | None = None):
        self._trace, self._interval = trace, interval_s
        self._index = (rng.randrange(len(trace)) if start is None else start % len(trace)) if trace else 0
        self._intervals = 0
        self.value = trace[self._index] if trace else 1.0
        self.next_change = interval_s if trace else math.inf

    def advance(self) -> float:
        """Move to the next interval; its speed."""
        self._intervals += 1
        self.next_change = (self._intervals + 1) * self._interval
        self._index = (self._index + 1) % len(self._trace)
        self.value = self._trace[self._index]
        return self.value


class Simulator:
    """One serving group in virtual time.

    Args:
        config: the scheduler's budgets and policies (ttft_slo_ms switches SLO admission on, predicted with
            `cost` itself unless `admission_cost` is given).
        num_blocks: KV blocks (what the worker would report for the memory budget).
        block_size: tokens per block.
        max_model_len: longest prompt + output.
        cost: the step-cost model (seconds per step from its shape).
        enable_prefix_caching: share full blocks of identical prefixes.
        max_concurrency: closed loop: at most this many unfinished requests; the next one is sent when one ends.
        admission_cost: the cost model SLO admission predicts with (default: `cost`); None with
            use_online_admission fits it online from the simulated steps, as a server without a profile does.
        seed: draws the step jitter and where cost.speed_trace starts.
        speed_start: the interval of cost.speed_trace the run starts at (None: drawn by the seed); 0 replays a
            trace measured alongside a real run in step with it.
    """

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int,
                 cost: StepCostModel, enable_prefix_caching: bool = True, max_concurrency: int | None = None,
                 admission_cost: StepCostModel | None = None, use_online_admission: bool = False, seed: int = 0,
                 speed_start: int | None = None):
        self.config = config
        self.cost = cost
        self.max_in_flight = 2 if config.async_scheduling else 1
        self.max_concurrency = max_concurrency
        self.speed_start = speed_start
        self.cores: SharedCores | None = None  # the last run's processes; their clock is the simulation's
        self._noise = random.Random(seed)  # step-time jitter (cost.jitter), seeded: runs repeat exactly
        self._slow: float | None = None  # the persistent part of the jitter's log, carried from step to step
        # admission gets the cost model and the virtual clock directly (the server's loop loads them from a file)
        admission = SloAdmission(config.ttft_slo_ms, None if use_online_admission else (admission_cost or cost),
                                 clock=lambda: self.now)
        self.scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching),
                                   max_model_len, (), admission)

    @property
    def now(self) -> float:
        """The virtual time in seconds: the clock of the run's processes (0 before a run)."""
        return self.cores.now if self.cores is not None else 0.0

    def _jittered(self, seconds: float) -> float:
        """The step's seconds times its log-normal factor (mean 1): a persistent part that decays over the step's
        own duration (cost.jitter_memory_s; idle time between steps is not counted), and a fresh part."""
        cost = self.cost
        sigma = cost.jitter
        if not sigma:
            return seconds
        slow_sigma = sigma * math.sqrt(cost.jitter_slow_share) if cost.jitter_memory_s > 0 else 0.0
        log_factor = math.sqrt(sigma * sigma - slow_sigma * slow_sigma) * self._noise.gauss(0.0, 1.0)
        if slow_sigma:
            if self._slow is None:  # the machine's state when the run starts: any, as often as it occurs
                self._slow = slow_sigma * self._noise.gauss(0.0, 1.0)
            keep = math.exp(-seconds / cost.jitter_memory_s)
            self._slow = keep * self._slow + math.sqrt(1 - keep * keep) * slow_sigma * self._noise.gauss(0.0, 1.0)
            log_factor += self._slow
        return seconds * math.exp(log_factor - sigma * sigma / 2)

    def run(self, workload: list[SimRequest]) -> SimResult:
        """Simulate the whole workload to its end. Raises RuntimeError if the scheduler can make no progress."""
        scheduler, cost = self.scheduler, self.cost
        order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
        records = [RequestRecord(w.arrival, len(w.prompt_token_ids), w.output_len) for w in workload]
        pending = deque(order)  # not yet sent, in arrival order
        # closed loop: when each of the max_concurrency client slots is free next (finishes come in time order)
        slots = deque([0.0] * self.max_concurrency) if self.max_concurrency is not None else None
        cores = SharedCores(("worker", "scheduler", "frontend", "client"), cost.cores, cost.cpu_weights)
        self.cores = cores  # kept for what each process ran and waited (calibrate.py fits the weights to it)
        in_flight: deque[_Flight] = deque()  # in the order planned
        samples: list[Sample] = []
        pool = scheduler.kv.pool
        served: list[ServedSeconds] = []
        reading: dict[str, tuple[list, list]] = {}  # request -> (its client read not done yet, the outputs in it)
        worker_done = 0.0  # when the worker's last step ended
        blocked_until = -math.inf  # nothing fitted at the last plan: wait for news, or for the idle poll
        news = True  # something the scheduler acts on happened since its last turn
        speed = _MachineSpeed(cost.speed_trace, cost.speed_interval_s, self._noise, self.speed_start)
        cores.speed = speed.value

        def unblock(_: float = 0.0) -> None:
            nonlocal blocked_until, news
            blocked_until = -math.inf
            news = True

        def next_send() -> float:  # when the client sends the next request
            if not pending or (slots is not None and not slots):
                return math.inf
            return max(workload[pending[0]].arrival, slots[0] if slots else 0.0)

        def send(at: float) -> None:
            index = pending.popleft()
            records[index].arrival = at
            if slots:
                slots.popleft()
            cores.submit("frontend", cost.ingress_s, lambda t: submitted(index, t))

        def send_due() -> None:
            while next_send() <= cores.now:
                send(next_send())

        def submitted(index: int, t: float) -> None:  # the frontend hands the request to the scheduler
            request = workload[index]
            scheduler.add_request(CLIENT, Submit(
                str(index), request.prompt_token_ids, SamplingParams(max_tokens=request.output_len,
                                                                     ignore_eos=True, temperature=0.0),
                t, ttft_slo_ms=request.ttft_slo_ms))
            unblock()
            deliver()  # a refusal comes back at once

        def deliver() -> None:  # the frontend streams each output, the client reads it
            outputs = scheduler.take_outputs().get(CLIENT, [])
            if outputs and cost.egress_step_s:
                cores.submit("frontend", cost.egress_step_s)
            for output in outputs:
                cores.submit("frontend", cost.egress_s * len(output.new_token_ids),
                             lambda _, output=output: streamed(output))

        def streamed(output) -> None:  # in the stream's socket: the client reads all that waits there at once
            work = (cost.client_cpu_request_s * (output.finish_reason is not None)
                    + cost.client_cpu_token_s * len(output.new_token_ids))
            read = reading.get(output.request_id)
            if read is not None and cores.waiting("client", read[0]):
                cores.add(read[0], work)
                read[1].append(output)
                return
            batch = [output]
            job = cores.submit("client", work, lambda t: read_done(output.request_id, batch, t))
            if job is not None:
                reading[output.request_id] = (job, batch)

        def read_done(request_id: str, batch: list, t: float) -> None:
            if reading.get(request_id, (None, None))[1] is batch:
                del reading[request_id]
            for output in batch:
                received(output, t)

        def received(output, t: float) -> None:
            record = records[int(output.request_id)]
            t += cost.client_s
            record.token_times.extend([t] * len(output.new_token_ids))
            if output.finish_reason is not None:
                record.finish = t
                if output.finish_reason == FinishReason.ERROR:
                    record.status = output.error_status or 500
                    record.retry_after_s = output.retry_after_s
                if slots is not None:  # closed loop: the client sends its next request now
                    slots.append(t)
                    send_due()

        def plan() -> bool:  # the scheduler's turn, when it is idle: plan the next step if it can, else settle
            nonlocal blocked_until
            if len(in_flight) < self.max_in_flight and scheduler.has_work and blocked_until < self.now:
                step = scheduler.schedule()
                if not step.is_empty:
                    flight = _Flight(step)
                    in_flight.append(flight)
                    samples.append(Sample(self.now, scheduler.num_waiting, len(scheduler.running),
                                          (pool.num_blocks - pool.num_free) / pool.num_blocks, step.num_tokens))
                    shape = shape_of((e.start, e.num_new, e.samples) for e in step.scheduled.values())
                    work = self._jittered(cost.worker_seconds(shape))

                    def result_back(t: float) -> None:
                        nonlocal news, worker_done
                        flight.result_back = news = True
                        served.append(ServedSeconds(shape, t - max(flight.sent_at, worker_done)))
                        worker_done = t

                    def planned(t: float) -> None:
                        nonlocal news
                        news = True
                        flight.sent_at = t
                        cores.submit("worker", work, result_back)

                    cores.submit("scheduler", cost.scheduler_s / 2, planned)
                    return True
                if not in_flight and next_send() == math.inf and cores.next_event() == math.inf:
                    raise RuntimeError("the scheduler can make no progress: nothing fits and nothing runs")
                blocked_until = math.inf if in_flight else self.now + IDLE_POLL_S
            if in_flight and in_flight[0].result_back:
                step = in_flight.popleft().step
                sampled = step.sampling_ids
                scheduler.update_from_output(step, StepResult(step.plan.step_id, sampled,
                                                              [FILLER_TOKEN] * len(sampled)))
                unblock()
                deliver()
                cores.submit("scheduler", cost.scheduler_s / 2, unblock)  # settling
                return True
            return False

        while True:
            timed_out = scheduler.num_timed_out
            scheduler.expire(self.now)
            news |= scheduler.num_timed_out != timed_out
            while news and not cores.busy("scheduler"):
                news = plan()
            idle_poll = blocked_until if not in_flight and blocked_until > self.now else math.inf
            upcoming = min(cores.next_event(), next_send(), idle_poll)
            if upcoming == math.inf:
                if scheduler.has_work or in_flight:
                    raise RuntimeError("the scheduler can make no progress: nothing fits and nothing runs")
                break
            cores.advance(min(upcoming, speed.next_change))
            if cores.now >= speed.next_change:
                cores.speed = speed.advance()
            if -math.inf < blocked_until <= self.now:  # the idle poll: try again
                unblock()
            send_due()
        start = min((r.arrival for r in records), default=0.0)
        end = max((r.finish for r in records if not math.isnan(r.finish)), default=start)
        return SimResult(records, samples, len(samples), scheduler.num_preemptions, end - start, served)
