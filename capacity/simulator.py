"""A discrete-event simulator of one serving group that drives the real Scheduler (scheduler/scheduler.py) with a
virtual clock and a step-cost model instead of a worker.

It models the in-process engine (scheduler and worker in one loop, no HTTP; capacity/calibrate.py's
`Calibrator.serve`), which is what carries over to other hardware: the worker runs each step for the cost model's
prediction of its shape (scheduler/step_cost.py), the scheduler plans and settles it (scheduler_s per step and
scheduler_sequence_s per sequence, half each), and every token reaches its client client_s after the step that
sampled it. What a full server adds on a given machine (HTTP, tokenization, the frontend's and the clients' CPU) is
measured and reported (docs/capacity.md), not modelled.

The scheduler has the overlapped loop's semantics (scheduler/loop.py): with async scheduling up to two plans are in
flight, step N+1 is planned as soon as step N was sent, the worker runs plans in order, and the scheduler settles a
step when its result is back and it is free, taking in requests whenever they arrive. Sampled tokens are fabricated
(never an end-of-sequence id: outputs have their workload length, as with `shuttle bench`'s ignore_eos), so
everything else (chunked prefill, KV blocks, prefix cache, preemption, admission, SLO refusals) is the real code's
behaviour.

Each step lasts its prediction times a factor drawn from the profile's `spread` (how much steps of one shape vary
on the calibrated machine; none without one), as a function of (seed, step number): near saturation the queue
grows with the variance of service times, not only their mean.

Deterministic: the same workload, configuration, cost model and seed give the same result, bit for bit.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from shuttle.capacity.workload import SimRequest
from shuttle.common.config import SchedulerConfig
from shuttle.common.messages import FinishReason, StepResult, Submit
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.admission import SloAdmission
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.pipeline import StepPipeline
from shuttle.scheduler.scheduled_step import ScheduledStep
from shuttle.scheduler.scheduler import Scheduler
from shuttle.scheduler.step_cost import StepCostModel, StepShape, shape_of

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
    scheduler_s: float = 0.0  # the scheduler's plan + settle seconds for it


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
        """`shuttle bench`'s summary keys: counts, throughput, goodput and mean/median/p90/p99 in ms of TTFT,
        TPOT, ITL and e2e (nearest-rank percentiles, as `shuttle bench` computes them). Goodput counts,
        as `shuttle bench`'s does, requests whose TTFT and mean inter-token time (TPOT) are within the objectives."""
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
    """mean, median, p90, p99 in milliseconds of values in seconds (`shuttle bench`'s nearest-rank rule)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)
    n = len(ordered)

    def rank(p: float) -> float:
        return ordered[min(n - 1, max(0, int(round(p / 100 * n + 0.5)) - 1))]

    middle = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"mean": 1000 * sum(ordered) / n, "median": 1000 * middle, "p90": 1000 * rank(90),
            "p99": 1000 * rank(99)}


class _Lane:
    """One single-threaded process in virtual time: its jobs run one after another, in the order submitted."""

    def __init__(self, events: list, clock: list[float]):
        self._events, self._clock = events, clock
        self.free_at = 0.0

    def busy(self) -> bool:
        return self.free_at > self._clock[0]

    def submit(self, seconds: float, on_done: Callable[[float], None] | None = None) -> None:
        """Run `seconds` of work after what is queued; on_done(t) at the virtual time t it ends."""
        self.free_at = max(self.free_at, self._clock[0]) + seconds
        heapq.heappush(self._events, (self.free_at, next(_ORDER), on_done))


_ORDER = itertools.count()  # ties in time keep submission order
_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A number in [0, 1) that is a function of (seed, index) alone: SplitMix64's finaliser (Steele, Lea and Flood,
    "Fast splittable pseudorandom number generators", OOPSLA 2014) over the pair."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


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
        seed: picks each step's factor from `cost.spread`.
    """

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int,
                 cost: StepCostModel, enable_prefix_caching: bool = True, max_concurrency: int | None = None,
                 admission_cost: StepCostModel | None = None, use_online_admission: bool = False, seed: int = 0):
        self.config = config
        self.cost = cost
        self.seed = seed
        self.max_in_flight = 2 if config.async_scheduling else 1
        self.max_concurrency = max_concurrency
        self._clock = [0.0]  # the virtual time in seconds, shared with the lanes
        # admission gets the cost model and the virtual clock directly (the server's loop loads them from a file)
        admission = SloAdmission(config.ttft_slo_ms, None if use_online_admission else (admission_cost or cost),
                                 clock=lambda: self.now)
        self.scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching),
                                   max_model_len, (), admission)

    @property
    def now(self) -> float:
        """The virtual time in seconds."""
        return self._clock[0]

    def run(self, workload: list[SimRequest]) -> SimResult:
        """Simulate the whole workload to its end. Raises RuntimeError if the scheduler can make no progress."""
        return _Run(self, workload).run()


class _Run:
    """One simulation of a workload: the clients, the scheduler's turns on its StepPipeline (the served loop's rules,
    scheduler/pipeline.py) and the worker, as events in virtual time."""

    def __init__(self, sim: Simulator, workload: list[SimRequest]):
        self.sim, self.workload = sim, workload
        self.scheduler, self.cost, self.clock = sim.scheduler, sim.cost, sim._clock
        order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
        self.records = [RequestRecord(w.arrival, len(w.prompt_token_ids), w.output_len) for w in workload]
        self.pending = deque(order)  # not yet sent, in arrival order
        # closed loop: when each of the max_concurrency client slots is free next (finishes come in time order)
        self.slots = deque([0.0] * sim.max_concurrency) if sim.max_concurrency is not None else None
        self.events: list = []  # (time, order, callback): the lanes' job ends
        self.worker, self.planner = _Lane(self.events, self.clock), _Lane(self.events, self.clock)
        self.pipeline = StepPipeline(self.scheduler, sim.max_in_flight)
        self.flights: deque[_Flight] = deque()  # the pipeline's steps in flight with their virtual times
        self.samples: list[Sample] = []
        self.served: list[ServedSeconds] = []
        self.worker_done = 0.0  # when the worker's last step ended
        self.blocked_until = -math.inf  # nothing fitted at the last plan: wait for news, or for the idle poll
        self.news = True  # something the scheduler acts on happened since its last turn

    @property
    def now(self) -> float:
        return self.clock[0]

    def run(self) -> SimResult:
        scheduler, events = self.scheduler, self.events
        while True:
            timed_out = scheduler.num_timed_out
            scheduler.expire(self.now)
            self.news |= scheduler.num_timed_out != timed_out
            while self.news and not self.planner.busy():
                self.news = self._turn()
            idle_poll = self.blocked_until if not self.flights and self.blocked_until > self.now else math.inf
            upcoming = min(events[0][0] if events else math.inf, self._next_send(), idle_poll)
            if upcoming == math.inf:
                if scheduler.has_work or self.flights:
                    raise RuntimeError("the scheduler can make no progress: nothing fits and nothing runs")
                break
            self.clock[0] = max(self.now, upcoming)
            while events and events[0][0] <= self.now:
                _, _, on_done = heapq.heappop(events)
                if on_done is not None:
                    on_done(self.now)
            if -math.inf < self.blocked_until <= self.now:  # the idle poll: try again
                self._unblock()
            self._send_due()
        records = self.records
        start = min((r.arrival for r in records), default=0.0)
        end = max((r.finish for r in records if not math.isnan(r.finish)), default=start)
        return SimResult(records, self.samples, len(self.samples), scheduler.num_preemptions, end - start,
                         self.served)

    def _unblock(self, _: float = 0.0) -> None:
        self.blocked_until = -math.inf
        self.news = True

    def _next_send(self) -> float:
        """When the client sends the next request."""
        if not self.pending or (self.slots is not None and not self.slots):
            return math.inf
        return max(self.workload[self.pending[0]].arrival, self.slots[0] if self.slots else 0.0)

    def _send_due(self) -> None:
        while self._next_send() <= self.now:
            at = self._next_send()
            index = self.pending.popleft()
            self.records[index].arrival = at
            if self.slots:
                self.slots.popleft()
            request = self.workload[index]
            sampling = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)
            self.scheduler.add_request(CLIENT, Submit(request_id=str(index), prompt_token_ids=request.prompt_token_ids,
                                                      sampling=sampling, arrival_time=at,
                                                      ttft_slo_ms=request.ttft_slo_ms))
            self._unblock()
            self._deliver()  # a refusal comes back at once

    def _deliver(self) -> None:
        """Each output reaches its client client_s later."""
        for output in self.scheduler.take_outputs().get(CLIENT, []):
            record = self.records[int(output.request_id)]
            t = self.now + self.cost.client_s
            record.token_times.extend([t] * len(output.new_token_ids))
            if output.finish_reason is not None:
                record.finish = t
                if output.finish_reason == FinishReason.ERROR:
                    record.status = output.error_status or 500
                    record.retry_after_s = output.retry_after_s
                if self.slots is not None:  # closed loop: the client sends its next request then
                    self.slots.append(t)

    def _turn(self) -> bool:
        """The scheduler's turn, when it is idle: plan the next step if it can, else settle the oldest if its result
        is back. False when it did neither."""
        if self.pipeline.can_plan and self.blocked_until < self.now:
            if self._plan():
                return True
            if not self.flights and self._next_send() == math.inf and not self.events:
                raise RuntimeError("the scheduler can make no progress: nothing fits and nothing runs")
            self.blocked_until = math.inf if self.flights else self.now + IDLE_POLL_S
        if self.flights and self.flights[0].result_back:
            self._settle()
            return True
        return False

    def _plan(self) -> bool:
        """Plan a step and hand it to the planner lane (then the worker); False when nothing could be planned."""
        step = self.pipeline.plan()
        if step is None:
            return False
        flight = _Flight(step)
        self.flights.append(flight)
        pool = self.scheduler.kv.pool
        self.samples.append(Sample(self.now, self.scheduler.num_waiting, len(self.scheduler.running),
                                   (pool.num_blocks - pool.num_free) / pool.num_blocks, step.num_tokens))
        shape = shape_of((e.start, e.num_new, e.samples) for e in step.scheduled.values())
        work = self.cost.predict(shape) * self.cost.spread_factor(uniform(self.sim.seed, len(self.samples)))
        flight.scheduler_s = self.cost.scheduler_seconds(shape)
        self.planner.submit(flight.scheduler_s / 2, functools.partial(self._planned, flight, shape, work))
        return True

    def _planned(self, flight: _Flight, shape: StepShape, work: float, t: float) -> None:
        """The plan reached the worker at `t`: it runs after the steps before it."""
        self.news = True
        flight.sent_at = t
        self.worker.submit(work, functools.partial(self._result_back, flight, shape))

    def _result_back(self, flight: _Flight, shape: StepShape, t: float) -> None:
        flight.result_back = self.news = True
        self.served.append(ServedSeconds(shape, t - max(flight.sent_at, self.worker_done)))
        self.worker_done = t

    def _settle(self) -> None:
        """Settle the oldest step with fabricated tokens; the scheduler's settling takes the other half of its time."""
        flight = self.flights.popleft()
        sampled = flight.step.sampling_ids
        self.pipeline.settle(StepResult(step_id=flight.step.plan.step_id, request_ids=sampled,
                                        token_ids=[FILLER_TOKEN] * len(sampled)))
        self._unblock()
        self._deliver()
        self.planner.submit(flight.scheduler_s / 2, self._unblock)
