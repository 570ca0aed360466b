"""Issue 11: the ZeroMQ batch protocol, in-process (the real app and batch endpoint over the scripted fake engine):
the same bodies and answers as HTTP, one answer per job, duplicates refused, heartbeats both ways, credit-based
backpressure, 503s retried, and `shuttle batch` on OpenAI batch files (resume, kill -9, a server that stops)."""

import asyncio
import json
import os
import signal
import sys
import time

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from shuttle.batch_jobs.client import AsyncBatchClient, BatchClient, BatchServerGone
from shuttle.common.messages import BatchHeartbeat, BatchPing, BatchRequest, BatchServerMessage
from shuttle.frontend.transports.zmq_batch import BatchEndpoint, _Client
from tests.batch_wire import HANG, dealer, next_response
from tests.inprocess import start_app
from tests.server import REPO

KEY = "sk-batch-protocol"


@pytest.fixture(scope="module")
async def app():
    app = await start_app(api_key=KEY, batch=True)
    yield app
    await app.close()


def comparable(body: dict) -> dict:
    """A response body without what differs between two calls (its id and creation time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


async def http(app, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        async with session.post(f"{app.url}{path}", json=body) as response:
            return response.status, await response.json()


async def run_jobs(app, jobs, **options) -> dict:
    async with AsyncBatchClient(app.batch.endpoint, api_key=KEY, **options) as client:
        return {r.job_id: r async for r in client.run(jobs)}


BODIES = [
    ("cmpl", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}),
    ("cmpl-n2-ids", "/v1/completions", {"prompt": [[1, 403], [1, 407]], "max_tokens": 3, "n": 2,
                                        "return_token_ids": True, "logprobs": 1}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4,
                                      "stop": [" play"], "logprobs": True, "top_logprobs": 2}),
    ("bad-max", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}),
    ("bad-type", "/v1/completions", {"prompt": "Hi", "temperature": "hot"}),
    ("no-messages", "/v1/chat/completions", {"max_tokens": 3}),
    ("bad-model", "/v1/completions", {"prompt": "Hi", "model": "gpt-4"}),
    ("bad-body", "/v1/completions", ["not", "an", "object"]),
]


async def test_batch_bodies_get_what_http_gets(app):
    streamed = [("stream-cmpl", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True}),
                ("stream-chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 2, "stream": True})]
    results = await run_jobs(app, [{"custom_id": i, "url": u, "body": b} for i, u, b in BODIES + streamed]
                             + [{"custom_id": "bad-url", "url": "/v1/embeddings", "body": {"input": "x"}}])
    for job_id, _, _ in streamed:  # one body per job: a stream is refused by name, not answered unstreamed
        assert (results[job_id].status_code, results[job_id].body["error"]["param"]) == (400, "stream"), job_id
    for job_id, url, body in BODIES:
        status, expected = await http(app, url, body)
        got = results[job_id]
        assert (got.status_code, comparable(got.body)) == (status, comparable(expected)), job_id
        if status == 200:
            assert got.request_id == got.body["id"]
            assert got.request_id.startswith("chatcmpl-" if "chat" in url else "cmpl-")
    assert results["bad-max"].body["error"]["param"] == "max_tokens"
    assert results["bad-type"].body["error"]["param"] == "temperature"
    assert results["no-messages"].body["error"]["param"] == "messages"
    assert results["bad-model"].status_code == 404
    assert (results["bad-url"].status_code, results["bad-url"].body["error"]["param"]) == (400, "url")
    assert results["cmpl"].body["choices"][0]["text"] and results["chat"].body["object"] == "chat.completion"


async def test_health_reports_batch_clients(app):
    sock = await dealer(app.batch.endpoint)
    try:
        await sock.send(job("h", max_tokens=1))
        assert (await next_response(sock)).status_code == 200
        async with aiohttp.ClientSession() as session, session.get(f"{app.url}/health") as response:
            batch = (await response.json())["batch"]
        assert batch["clients"] >= 1 and batch["jobs_in_flight"] == 0 and batch["clients_lost"] == 0
    finally:
        sock.close()


async def test_batch_requests_are_background_work(app):
    submitted = len(app.engine.submitted)
    await run_jobs(app, [{"url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}])
    assert await http(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    batch_job, http_job = app.engine.submitted[submitted:]
    assert batch_job.background and not http_job.background


def job(job_id: str, max_tokens: int = 8, key: str = KEY) -> bytes:
    return msgspec.msgpack.encode(BatchRequest(job_id=job_id, url="/v1/completions", body={"prompt": "Hi",
                                                                                           "max_tokens": max_tokens},
                                               api_key=key))


async def test_a_second_job_with_a_running_id_is_refused_and_the_first_goes_on(app):
    app.engine.step_delay = 0.05
    sock = await dealer(app.batch.endpoint)
    try:
        await sock.send(job("same"))
        await sock.send(job("same"))
        first, second = await next_response(sock), await next_response(sock)
        assert (first.job_id, first.status_code, first.body["error"]["param"]) == ("same", 400, "job_id")
        assert (second.job_id, second.status_code) == ("same", 200)
        assert second.body["usage"]["completion_tokens"] == 8
    finally:
        app.engine.step_delay = 0.0
        sock.close()


async def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_silent_client_has_its_jobs_aborted(app):
    endpoint = BatchEndpoint(app.state, "tcp://127.0.0.1:*", KEY, client_timeout=0.5, heartbeat=0.1)
    serving = asyncio.create_task(endpoint.serve())
    app.engine.step_delay = 0.5  # 8 tokens: 4 s per job unless aborted
    sock = await dealer(endpoint.endpoint)
    try:
        for i in range(5):
            await sock.send(job(f"j{i}"))
        await wait_until(lambda: app.engine.num_in_flight == 5, "jobs started")
        heartbeats = 0
        while heartbeats < 2:  # the server beats to a live client
            heartbeats += isinstance(msgspec.msgpack.decode(await asyncio.wait_for(sock.recv(), HANG),
                                                            type=BatchServerMessage), BatchHeartbeat)
        # the client now says nothing more: its jobs are aborted long before they would have finished
        await wait_until(lambda: app.engine.num_in_flight == 0, "silent client's jobs aborted")
        assert endpoint.num_clients_lost == 1 and not endpoint.clients
        # a client that was only slow, not dead, still gets one terminal answer per job
        answers = [await next_response(sock) for _ in range(5)]
        assert sorted((a.job_id, a.status_code) for a in answers) == [(f"j{i}", 408) for i in range(5)]
    finally:
        app.engine.step_delay = 0.0
        sock.close()
        serving.cancel()
        endpoint.close()


async def test_nobody_is_taken_as_silent_while_messages_wait_unread(app):
    """A trial: 10,000 jobs sent at once kept the event loop so busy that the client's pings sat unread, and 4,224
    of its jobs were aborted as a silent client's (408) while it pinged every half second."""
    endpoint = BatchEndpoint(app.state, "tcp://127.0.0.1:*", KEY, client_timeout=0.3, heartbeat=0.05)
    sock = await dealer(endpoint.endpoint)
    serving = None
    try:
        endpoint.clients[b"quiet"] = _Client(time.monotonic() - 10)  # last heard long ago, by the server's count
        await sock.send(msgspec.msgpack.encode(BatchPing()))  # unread: no receive loop runs yet
        await wait_until(endpoint.channel.has_unread, "the ping arrived")
        watching = asyncio.create_task(endpoint._watch())
        await asyncio.sleep(0.3)  # six heartbeat periods
        assert b"quiet" in endpoint.clients  # not judged while the reader is behind: its ping may be what waits
        watching.cancel()
        serving = asyncio.create_task(endpoint.serve())  # the backlog read: now silence is silence
        await wait_until(lambda: b"quiet" not in endpoint.clients, "a silent client dropped once all is read")
        assert len(endpoint.clients) == 1  # the pinging client stays
    finally:
        sock.close()
        if serving is not None:
            serving.cancel()
        endpoint.close()


async def test_a_silent_server_raises_naming_the_endpoint():
    ctx = zmq.asyncio.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # takes jobs, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        async with AsyncBatchClient(endpoint, server_timeout=0.5) as client:
            with pytest.raises(BatchServerGone, match=endpoint.replace(".", r"\.")):
                async for _ in client.run([{"body": {"prompt": "Hi"}}]):
                    pass
    finally:
        silent.close()


async def test_credit_bounds_jobs_in_flight_and_503s_are_retried(app):
    app.engine.step_delay = 0.01
    app.engine.down_reason = "a test's restart"  # every job is refused with 503 + Retry-After at first
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, app.engine.num_in_flight)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    asyncio.get_running_loop().call_later(0.3, setattr, app.engine, "down_reason", None)
    try:
        async with AsyncBatchClient(app.batch.endpoint, max_in_flight=3, api_key=KEY) as client:
            results = [r async for r in client.run({"custom_id": str(i), "body": {"prompt": "Hi", "max_tokens": 4}}
                                                   for i in range(20))]
        assert client.num_retried >= 3  # the first three were refused, then retried, never reported
    finally:
        watcher.cancel()
        app.engine.step_delay = 0.0
        app.engine.down_reason = None
    assert sorted(int(r.job_id) for r in results) == list(range(20))
    assert {r.status_code for r in results} == {200}
    assert 1 <= peak <= 3


async def test_jobs_a_shutting_down_server_refuses_wait_for_its_next_instance_not_retried():
    """A fresh-clone trial: while the server drained, the client resent its refused jobs every 0.2 s until the
    server fell silent. A 503 while draining says should_retry false; the client holds those jobs (for a restarted
    server's next instance) and, when the server goes quiet, names them in BatchServerGone."""
    draining = await start_app(api_key=KEY, batch=True)
    draining.engine.draining = True
    try:
        async with AsyncBatchClient(draining.batch.endpoint, max_in_flight=3, api_key=KEY,
                                    server_timeout=1.0) as client:
            asyncio.get_running_loop().call_later(0.6, draining.batch.close)  # then the server falls silent
            with pytest.raises(BatchServerGone, match=r"3 job\(s\) unanswered, 3 of them refused as it shut down"):
                async for _ in client.run({"custom_id": str(i), "body": {"prompt": "Hi"}} for i in range(5)):
                    pass
        assert client.num_retried == 0
    finally:
        await draining.close()


async def test_sync_batch_client(app):
    def run() -> list:
        with BatchClient(app.batch.endpoint, 2, api_key=KEY) as client:
            return list(client.run([{"custom_id": "a", "body": {"prompt": "Hi", "max_tokens": 3}},
                                    {"custom_id": "b", "url": "/v1/chat/completions",
                                     "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}]))
    results = {r.job_id: r for r in await asyncio.to_thread(run)}
    assert results["a"].body["usage"]["completion_tokens"] == 3
    assert results["b"].body["choices"][0]["message"]["role"] == "assistant"


# ---- shuttle batch ----------------------------------------------------------------------------------------------

def batch_file(path, n: int) -> list[str]:
    """n lines: completions and chat mixed, every 10th line malformed, every 7th body invalid. Returns the ids
    each output line is keyed by (custom_id, or the line number for lines without a readable one)."""
    keys, lines = [], []
    for i in range(n):
        if i % 10 == 9:  # not JSON; a method other than POST, or none (OpenAI's batch input requires it)
            lines.append("{not json" if i % 20 == 9 else json.dumps({"custom_id": f"m{i}", "url": "/v1/completions",
                                                                    "body": {}, **({"method": "GET"} if i % 40 == 19
                                                                                   else {})}))
            keys.append(f"line:{i + 1}" if i % 20 == 9 else f"m{i}")
            continue
        if i == 11:  # a key OpenAI's batch input does not have
            lines.append(json.dumps({"custom_id": f"m{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": "Story", "max_tokens": 3}, "foo": 1}))
            keys.append(f"m{i}")
            continue
        body = {"prompt": f"Story {i}", "max_tokens": 3} if i % 2 else {
            "messages": [{"role": "user", "content": f"Story {i}"}], "max_tokens": 3}
        if i % 7 == 6:
            body["max_tokens"] = -1
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/completions" if i % 2 else "/v1/chat/completions", "body": body}))
        keys.append(f"r{i}")
    path.write_text("\n".join(lines) + "\n")
    return keys


def output_keys(path) -> list[str]:
    keys = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        keys.append(record["custom_id"] if record["custom_id"] is not None else f"line:{record['error']['line']}")
    return keys


async def shuttle_batch(*args: str, **popen) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shuttle.launcher.cli", "batch", *args, "--quiet", cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "SHUTTLE_API_KEY": KEY},
        **popen)


def _sigint_as_a_terminal_sends_it() -> None:
    """In the child before exec: SIGINT's default action, so that Python installs its KeyboardInterrupt handler.
    A shell runs a background job (CI's `.ci/run &`) with SIGINT ignored, every descendant inheriting that, and
    Python leaves an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def finish(process) -> tuple[int, str]:
    _, stderr = await asyncio.wait_for(process.communicate(), HANG)
    return process.returncode, stderr.decode()


async def test_shuttle_batch_file_kill_9_and_resume(app, tmp_path):
    endpoint = BatchEndpoint(app.state, "tcp://127.0.0.1:*", KEY, client_timeout=1.5, heartbeat=0.1)
    serving = asyncio.create_task(endpoint.serve())
    keys = batch_file(tmp_path / "in.jsonl", 200)
    out = tmp_path / "out.jsonl"
    app.engine.step_delay = 0.6  # a job (3 tokens) lasts longer than the endpoint's client timeout
    try:
        process = await shuttle_batch(str(tmp_path / "in.jsonl"), str(out), "--endpoint", endpoint.endpoint,
                                      "--max-in-flight", "50")
        await wait_until(lambda: out.exists() and len(out.read_text().splitlines()) >= 100, "half the file")
        process.send_signal(signal.SIGKILL)
        await process.wait()
        await wait_until(lambda: app.engine.num_in_flight == 0, "dead client's jobs ended")
        assert endpoint.num_clients_lost == 1  # they were aborted: the client fell silent with jobs running
        app.engine.step_delay = 0.0
        code, stderr = await finish(await shuttle_batch(str(tmp_path / "in.jsonl"), str(out), "--endpoint",
                                                        endpoint.endpoint))
    finally:
        app.engine.step_delay = 0.0
        serving.cancel()
        endpoint.close()
    assert code == 0, stderr
    got = output_keys(out)
    assert len(got) == 200 and sorted(got) == sorted(keys)  # every line once: none missing, none twice
    records = {k: json.loads(line) for k, line in zip(got, out.read_text().splitlines())}
    assert records["r0"]["response"]["status_code"] == 200
    assert records["r0"]["response"]["body"]["object"] == "chat.completion"
    assert records["r1"]["response"]["body"]["choices"][0]["text"]
    assert records["r6"]["response"]["status_code"] == 400
    assert records["r6"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert records["m19"]["error"]["code"] == "invalid_line" and records["m19"]["response"] is None
    assert "method must be POST, got 'GET'" in records["m19"]["error"]["message"]
    assert "method must be POST, got None" in records["m39"]["error"]["message"] and records["m39"]["response"] is None
    assert "key 'foo' is not one of OpenAI's batch input" in records["m11"]["error"]["message"]
    assert records["line:10"]["custom_id"] is None and "not JSON" in records["line:10"]["error"]["message"]


async def test_ctrl_c_on_shuttle_batch_is_one_line_and_a_rerun_finishes(app, tmp_path):
    """It printed a KeyboardInterrupt traceback (the resume was already right)."""
    keys = batch_file(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out.jsonl"
    app.engine.step_delay = 0.2  # 4 jobs of 3 tokens at a time: the file takes ~9 s, the signal comes at ~1 s
    try:
        process = await shuttle_batch(str(tmp_path / "in.jsonl"), str(out), "--endpoint", app.batch.endpoint,
                                      "--max-in-flight", "4", preexec_fn=_sigint_as_a_terminal_sends_it)
        await wait_until(lambda: out.exists() and len(out.read_text().splitlines()) >= 8, "a few answers")
        assert process.returncode is None
        process.send_signal(signal.SIGINT)
        code, stderr = await finish(process)
        app.engine.step_delay = 0.0
        await wait_until(lambda: app.engine.num_in_flight == 0, "the interrupted client's jobs ended")
        rerun, rerun_stderr = await finish(await shuttle_batch(str(tmp_path / "in.jsonl"), str(out), "--endpoint",
                                                               app.batch.endpoint))
    finally:
        app.engine.step_delay = 0.0
    assert code == 130 and stderr.strip().splitlines() == [
        f"shuttle batch: interrupted; {out} holds every answer received, rerun the same command to finish"], stderr
    assert rerun == 0, rerun_stderr
    got = output_keys(out)
    assert len(got) == 60 and sorted(got) == sorted(keys)


async def test_shuttle_batch_refuses_duplicate_ids_before_sending(app, tmp_path):
    lines = [{"custom_id": c, "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 1}} for c in "aba"]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    submitted = len(app.engine.submitted)
    code, stderr = await finish(await shuttle_batch(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                                    "--endpoint", app.batch.endpoint))
    assert code == 2 and "duplicate custom_id" in stderr and "'a' (line 3)" in stderr
    assert len(app.engine.submitted) == submitted and not (tmp_path / "out.jsonl").exists()


async def test_shuttle_batch_without_the_key_gets_401_and_no_work(app, tmp_path):
    batch_file(tmp_path / "in.jsonl", 5)
    submitted = len(app.engine.submitted)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shuttle.launcher.cli", "batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
        "--endpoint", app.batch.endpoint, "--quiet", "--api-key", "wrong", cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    code, stderr = await finish(process)
    assert code == 0, stderr
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    statuses = [json.loads(line)["response"]["status_code"] for line in lines]
    assert statuses == [401] * 5
    assert len(app.engine.submitted) == submitted


async def test_shuttle_batch_exits_when_the_server_stops_and_a_rerun_completes(app, tmp_path):
    endpoint = BatchEndpoint(app.state, "tcp://127.0.0.1:*", KEY)
    address = endpoint.endpoint
    serving = asyncio.create_task(endpoint.serve())
    keys = batch_file(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out.jsonl"
    app.engine.step_delay = 0.02
    try:
        process = await shuttle_batch(str(tmp_path / "in.jsonl"), str(out), "--endpoint", address,
                                      "--max-in-flight", "4", "--server-timeout", "2")
        await wait_until(lambda: out.exists() and len(out.read_text().splitlines()) >= 20, "a third of the file")
        serving.cancel()
        endpoint.close()  # the server stops answering mid-job
        code, stderr = await finish(process)
        assert code == 1 and address in stderr and "rerun" in stderr
        partial = output_keys(out)
        assert 20 <= len(partial) < 60 and len(set(partial)) == len(partial)
        await wait_until(lambda: app.engine.num_in_flight == 0, "jobs of the stopped endpoint ended")
        endpoint = BatchEndpoint(app.state, address, KEY)  # the server is back on the same address
        serving = asyncio.create_task(endpoint.serve())
        code, stderr = await finish(await shuttle_batch(str(tmp_path / "in.jsonl"), str(out), "--endpoint", address))
        assert code == 0, stderr
        assert sorted(output_keys(out)) == sorted(keys)
    finally:
        app.engine.step_delay = 0.0
        serving.cancel()
        endpoint.close()


async def bind_again(app, address: str) -> BatchEndpoint:
    """A new endpoint on the address a closed one held (its port may take a moment to be free again)."""
    deadline = time.monotonic() + HANG
    while True:
        try:
            return BatchEndpoint(app.state, address, KEY)
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "address never freed"
            await asyncio.sleep(0.05)


async def test_jobs_lost_to_a_quick_server_restart_are_sent_again(app):
    first = BatchEndpoint(app.state, "tcp://127.0.0.1:*", KEY, heartbeat=0.1)
    address = first.endpoint
    serving = asyncio.create_task(first.serve())
    app.engine.step_delay = 0.05
    second = None
    try:
        # without the resend this would wait forever: the new server's heartbeats keep the client content
        async with asyncio.timeout(HANG), AsyncBatchClient(address, max_in_flight=10, api_key=KEY,
                                                           server_timeout=HANG) as client:
            results = []
            async for r in client.run({"custom_id": str(i), "body": {"prompt": "Hi", "max_tokens": 4}}
                                      for i in range(30)):
                results.append(r)
                if len(results) == 5:  # the frontend restarts, well within the client's timeout
                    serving.cancel()
                    first.close()
                    second = await bind_again(app, address)
                    serving = asyncio.create_task(second.serve())
        assert client.num_resent >= 1
    finally:
        app.engine.step_delay = 0.0
        serving.cancel()
        for endpoint in (first, second):
            if endpoint is not None:
                endpoint.close()
    assert sorted(int(r.job_id) for r in results) == list(range(30)) and {r.status_code for r in results} == {200}


async def test_a_retry_that_comes_back_before_the_refused_job_ended_is_run(app, monkeypatch):
    """A fresh-clone trial once saw a batch client wait forever after a worker restart, the server holding no job
    of it. The race: a job's 503 went out while its task still ran (it ends just after), the client's retry came
    back within that moment and was refused as "already running", which the client takes for a resend's echo and
    drops. Here the answer is slow to let go (the task lingers 1.5 s after each 503): the retry is still run."""
    answer = app.batch._answer

    async def lingering(identity, message):
        await answer(identity, message)
        if getattr(message, "status_code", 0) == 503:
            await asyncio.sleep(1.5)  # past the 1 s Retry-After of an engine down with no estimate

    monkeypatch.setattr(app.batch, "_answer", lingering)
    app.engine.down_reason = "a test's restart"
    asyncio.get_running_loop().call_later(0.1, setattr, app.engine, "down_reason", None)
    try:
        async with AsyncBatchClient(app.batch.endpoint, api_key=KEY) as client:
            results = await asyncio.wait_for(
                _all(client.run([{"custom_id": "once", "body": {"prompt": "Hi", "max_tokens": 2}}])), HANG)
    finally:
        app.engine.down_reason = None
    assert [(r.job_id, r.status_code) for r in results] == [("once", 200)] and client.num_retried == 1


async def _all(responses) -> list:
    return [r async for r in responses]


async def test_jobs_the_server_could_not_read_are_answered_by_the_client_and_the_rest_run(app):
    """A job nested deeper than the server reads (its 400 could name no job) or larger than its frame limit (it
    would drop the connection, and the answers of the jobs beside it with it) is answered by the client with a 400
    and never sent; the jobs around it run as usual."""
    deep: object = "x"
    for _ in range(200):
        deep = [deep]
    jobs = [{"custom_id": "small1", "body": {"prompt": "Hi", "max_tokens": 2}},
            {"custom_id": "deep", "body": {"prompt": "Hi", "max_tokens": 2, "extra": deep}},
            {"custom_id": "huge", "body": {"prompt": "Hi " * 2_000_000, "max_tokens": 2}},
            {"custom_id": "small2", "body": {"prompt": "Hi", "max_tokens": 2}}]
    async with AsyncBatchClient(app.batch.endpoint, api_key=KEY, server_timeout=HANG) as client:
        results = {r.job_id: r async for r in client.run(jobs)}
    assert {job_id: r.status_code for job_id, r in results.items()} == {"small1": 200, "deep": 400, "huge": 400,
                                                                       "small2": 200}
    assert "nests deeper than the 128 levels" in results["deep"].body["error"]["message"]
    assert "over the server's 4194304 (--max-batch-message-bytes)" in results["huge"].body["error"]["message"]
