"""Retry-After tells the truth (issue 24): the full-queue promise is a place in line over the rate at which the
waiting queue frees slots, a restart's is the measured restart time, and a draining server promises nothing.
Clocks are fabricated; the HTTP and WebSocket answers come from the real app over an in-process fake engine."""

import json

import aiohttp
import pytest

from shuttle.frontend.engine.backpressure import RestartClock, RetryAfterEstimator, header_value, refusal_headers
from shuttle.launcher.supervised_unit import Unit
from tests.inprocess import start_app


def saturated(estimator: RetryAfterEstimator, per_second: int, seconds: int = 6, start: float = 100.0,
              waiting: int = 50, admitted_before: int = 0) -> float:
    """Feed one stats sample a second with `waiting` requests waiting and `per_second` admissions; returns the
    last sample's time."""
    for second in range(seconds + 1):
        estimator.observe(start + second, admitted_before + per_second * second, num_waiting=waiting)
    return start + seconds


def test_full_queue_promise_is_the_place_in_line_over_the_rate_of_freed_slots():
    estimator = RetryAfterEstimator()
    assert estimator.refused(0.0) == 1.0  # nothing measured yet: a second
    now = saturated(estimator, 100)
    assert estimator.admission_rate() == pytest.approx(100.0)
    # the queue is full: the k-th refused client needs the k-th slot to open, k / 100 s from now
    assert [estimator.refused(now) for _ in range(3)] == pytest.approx([0.01, 0.02, 0.03])


def test_free_slots_in_stats_are_not_counted_open_after_a_refusal():
    estimator = RetryAfterEstimator()
    now = saturated(estimator, 100, waiting=47)  # three slots free in the latest stats, but the queue refused
    # the refusal says the queue was full: those slots were taken since (stats lag), the line starts from none
    assert [estimator.refused(now) for _ in range(2)] == pytest.approx([0.01, 0.02])


def test_a_promise_stops_counting_when_it_falls_due():
    estimator = RetryAfterEstimator()
    now = saturated(estimator, 100)
    assert estimator.refused(now) == pytest.approx(0.01)
    # 20 ms later that client has come back (in, or refused with a new promise): the next one is first in line
    assert estimator.refused(now + 0.02) == pytest.approx(0.01)


def test_a_slower_rate_continues_the_line_instead_of_opening_a_gap_in_it():
    estimator = RetryAfterEstimator()
    now = saturated(estimator, 100)  # t = 106
    for _ in range(3000):  # at 100 slots a second: due back over the next 30 s
        estimator.refused(now)
    now = saturated(estimator, 50, seconds=12, start=now, admitted_before=600)  # t = 118, and half the speed
    assert estimator.admission_rate() == pytest.approx(50.0)
    # 1,800 promises are still pending, until t = 136. Counted again at the new rate they would say 36 s, and
    # nobody would come back in the 18 s after t = 136 while the queue drains; the line goes on from its end
    # (those of them refused again for want of a slot get new promises behind it)
    assert estimator.refused(now) == pytest.approx(136 - 118 + 1 / 50)


def test_filling_an_idle_running_set_is_no_rate_and_bounds_the_wait_until_requests_finish():
    estimator = RetryAfterEstimator()
    estimator.observe(100.0, 0, num_waiting=200, num_running=0)  # a burst on an idle engine
    estimator.observe(100.1, 128, num_waiting=200, num_running=128)  # 128 admitted at once into free capacity
    estimator.observe(100.6, 128, num_waiting=200, num_running=128)
    for t in (101.1, 101.6, 102.0):  # two finish early (two more take their places): too few to tell a pace
        estimator.observe(t, 130, num_waiting=200, num_running=128)
    assert estimator.admission_rate() is None  # the fill opened 128 slots once; it says nothing about the pace
    # the running set has hardly turned over in the 2 s since requests began to wait: the rate is at most about
    # 128 / 2 a second, so the 200th in line waits at least 200 / (128 / 2) s (never less than a second while
    # nothing is measured)
    waits = [estimator.refused(102.0) for _ in range(200)]
    assert waits[0] == 1.0 and waits[-1] == pytest.approx(200 * 2.0 / 128)
    estimator.observe(103.0, 130, num_waiting=200, num_running=2)  # the other 126 finish together
    estimator.observe(103.1, 256, num_waiting=200, num_running=128)  # 128 more admitted in their place
    assert estimator.admission_rate() == pytest.approx(128 / 3.1)  # 128 slots in the 3.1 s since the burst


def test_a_newcomer_takes_a_slot_between_sparse_promises():
    estimator = RetryAfterEstimator()
    now = saturated(estimator, 2, seconds=11)  # t = 111, two slots a second
    for _ in range(100):
        estimator.refused(now)  # due back every half second until t = 161
    now = saturated(estimator, 100, seconds=11, start=now, admitted_before=22)  # t = 122: now 100 a second
    # the 78 clients still asleep come back every half second; a slot opens every hundredth of a second: the
    # newcomer takes the first, ahead of none of them (counting them all as ahead would say 0.79 s, the line's
    # end 39 s, while the queue drains)
    assert estimator.refused(now) == pytest.approx(0.01)


def test_no_promise_is_longer_than_the_official_clients_honour():
    estimator = RetryAfterEstimator()
    now = saturated(estimator, 20)  # 20 slots a second
    waits = [estimator.refused(now) for _ in range(3000)]  # the last in line needs 150 s
    assert waits[1199] == pytest.approx(60.0) and max(waits) == pytest.approx(60.0)  # they retry, and are told again
    clock = RestartClock()
    clock.down(0.0, expected=300.0)
    assert clock.retry_after(1.0) == pytest.approx(60.0)


def test_preempted_requests_open_no_slot():
    estimator = RetryAfterEstimator()
    for second in range(7):  # 10 finish a second; 5 more a second are preempted (back to the queue) and resumed
        estimator.observe(100.0 + second, 15 * second, num_waiting=50, num_running=100, num_preemptions=5 * second)
    assert estimator.admission_rate() == pytest.approx(10.0)


def test_rate_counts_only_intervals_with_requests_waiting():
    estimator = RetryAfterEstimator()
    for second in range(6):  # admitted as they arrive: the rate says nothing about capacity
        estimator.observe(float(second), 7 * second, num_waiting=0)
    assert estimator.admission_rate() is None


def test_restart_promise_is_the_measured_restart_time_less_the_time_down():
    clock = RestartClock()
    clock.down(10.0, expected=6.0)  # the launcher's estimate: its backoff plus the measured start-up
    assert clock.retry_after(12.0) == pytest.approx(4.0)
    # overrun: no wild guess (it said half again the time down), a retry a second later, refused at no cost
    assert clock.retry_after(17.0) == pytest.approx(1.0)
    clock.up(15.0)  # this restart took 5 s
    clock.down(100.0)  # a remote group, with no launcher to estimate: the restart measured before
    assert clock.retry_after(101.0) == pytest.approx(4.0)
    clock.up(103.0)
    clock.down(200.0, expected=8.0)  # the launcher's estimate, when it gives one, knows this restart's backoff
    assert clock.retry_after(201.0) == pytest.approx(7.0)


def test_launcher_expects_the_last_measured_start_not_half_again_the_slowest():
    unit = Unit("engine", ("worker", "scheduler"))
    unit.start_durations = [9.0, 5.5]  # the first start (cold caches), then a restart
    assert unit.expected_start_s() == pytest.approx(5.5)


def test_refusal_headers():
    assert refusal_headers(2.2) == {"Retry-After": "3", "retry-after-ms": "2200"}
    assert refusal_headers(0.004) == {"Retry-After": "1", "retry-after-ms": "4"}
    assert refusal_headers(None) == {"Retry-After": "1", "retry-after-ms": "1000"}  # unknown: a second
    assert refusal_headers(5.0, going_away=True) == {"Connection": "close", "x-should-retry": "false"}
    assert header_value(0.01) == "1" and header_value(2.2) == "3"


async def test_a_draining_server_promises_nothing_and_closes_the_connection():
    app = await start_app()
    try:
        app.engine.draining = True
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{app.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}) as response:
                assert response.status == 503 and "shutting down" in (await response.json())["error"]["message"]
                assert "Retry-After" not in response.headers and "retry-after-ms" not in response.headers
                assert response.headers["Connection"] == "close" and response.headers["x-should-retry"] == "false"
            async with session.get(f"{app.url}/health") as response:
                assert response.status == 503 and (await response.json())["status"] == "draining"
                assert "Retry-After" not in response.headers and response.headers["Connection"] == "close"
            async with session.ws_connect(f"{app.url}/v1/ws") as ws:
                await ws.send_str(json.dumps({"type": "generate", "id": 1, "prompt": "Hi", "max_tokens": 2}))
                frame = json.loads((await ws.receive()).data)
        assert frame["type"] == "error" and frame["error"]["code"] == 503
        assert "retry_after" not in frame and frame["should_retry"] is False
    finally:
        await app.close()


async def test_a_restarting_engine_promises_its_restart_time_in_seconds_and_milliseconds():
    app = await start_app()
    try:
        app.engine.engine_down("worker died", 30.0)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{app.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}) as response:
                assert response.status == 503 and response.headers.get("Connection") != "close"
                milliseconds = int(response.headers["retry-after-ms"])  # 30 s less the time since, in ms
                assert 1000 < milliseconds <= 30_000
                assert response.headers["Retry-After"] == str(-(-milliseconds // 1000))  # whole seconds, rounded up
                assert "x-should-retry" not in response.headers
    finally:
        await app.close()
