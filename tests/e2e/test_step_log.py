"""`--step-log`: every served step's shape and duration, as calibrate.py fits the serving corrections from."""

from types import SimpleNamespace

import aiohttp

from shuttle.scheduler.step_log import StepLog, read_step_log
from tests.client import post_completion, wait_idle
from tests.conftest import SLOW_STEP_DELAY


def entries(*chunks):
    return {str(i): SimpleNamespace(start=s, num_new=n, samples=k) for i, (s, n, k) in enumerate(chunks)}


def test_a_step_runs_from_its_send_or_the_previous_result_whichever_is_later(tmp_path):
    """With two plans in flight the second waits for the first: its time starts when the first's result is back."""
    log = StepLog(tmp_path / "steps.jsonl")
    log.record(entries((0, 12, True)), sent_at=10.0, result_at=10.5)
    log.record(entries((12, 1, True), (0, 5, False)), sent_at=10.1, result_at=10.8)  # queued behind the first
    log.record(entries((13, 1, True)), sent_at=11.0, result_at=11.25)  # the worker was idle: from its send
    log.close()
    steps = read_step_log(tmp_path / "steps.jsonl")
    assert [round(s.seconds, 9) for s in steps] == [0.5, 0.3, 0.25]
    assert [(s.num_tokens, s.num_prefill_seqs, s.num_decode_seqs, s.num_sampled) for s in steps] == [
        (12, 1, 0, 1), (6, 1, 1, 1), (1, 0, 1, 1)]
    assert steps[1].shape.prefill_attention == 25 and steps[1].shape.decode_attention == 13
    assert [s.ended_at for s in steps] == [10.5, 10.8, 11.25]  # when each result was back, to line steps up in time
    (tmp_path / "old.jsonl").write_text("[0.5,12,1,0,78,0,1]\n")  # a line written before ended_at existed
    assert read_step_log(tmp_path / "old.jsonl")[0].ended_at == 0.0


async def test_the_server_logs_each_step_it_runs(slow_server):
    path = slow_server.step_log_path
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, slow_server.url)
        before = len(read_step_log(path))  # the shared server's earlier steps
        status, body = await post_completion(session, slow_server.url, prompt="Once upon a time", max_tokens=4,
                                             temperature=0, ignore_eos=True, return_token_ids=True)
        await wait_idle(session, slow_server.url)
    assert status == 200, body
    prompt_len = len(body["choices"][0]["prompt_token_ids"])
    steps = read_step_log(path)[before:]
    # one prefill step that samples the first token, then one decode step per further token
    assert [(s.num_tokens, s.num_prefill_seqs, s.num_decode_seqs, s.num_sampled) for s in steps] == [
        (prompt_len, 1, 0, 1)] + [(1, 0, 1, 1)] * 3
    assert [s.decode_attention for s in steps[1:]] == [prompt_len + 1, prompt_len + 2, prompt_len + 3]
    # The worker's time is in it (the step_delay hook). Not step by step: a step's time starts when the scheduler
    # reads the previous result, so a result read late moves time from the next step into that one (a fresh-clone
    # CI on a loaded machine saw one step under the delay). The steps' times are contiguous, so their sum holds
    # every step's delay.
    assert sum(s.seconds for s in steps) >= len(steps) * SLOW_STEP_DELAY and all(s.seconds < 5 for s in steps)
