"""Bad input to the capacity tools (`shuttle simulate`, `tune`, `calibrate`): a one-line
usage error naming what is wrong (exit status 2), never a traceback, and never a table of nonsense."""

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from shuttle.scheduler.step_cost import StepCostModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))

import compare_inprocess  # noqa: E402

from shuttle.capacity import bench_serve, calibrate, simulate, tune  # noqa: E402
from shuttle.capacity.workload import from_trace  # noqa: E402

MODEL = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K"


@pytest.fixture
def profile(tmp_path) -> Path:
    path = tmp_path / "profile.json"
    StepCostModel({"step": 0.003, "token": 2e-5, "sequence": 1e-4}, client_s=0.001,
                  meta={"max_model_len": 512, "vocab_size": 512, "kv_bytes_per_token": 1280}).save(path)
    return path


def refused(main, argv, capsys) -> str:
    """main(argv) must stop with a usage error: its last line of stderr."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("content, says", [
    (None, "cannot read the step-cost profile"),
    ("{not json", "is not JSON"),
    ("[1, 2]", "holds no `coefficients` object"),
    ('{"coefficients": "oops"}', "holds no `coefficients` object"),
    ('{"coefficients": {}}', "its `coefficients` object is empty"),
    ('{"coefficients": {"step": 0.001}, "client_s": -1}', "negative or missing values: client_s"),
    ('{"coefficients": {"warp": 1.0}}', "unknown cost model features"),
    ('{"coefficients": {"step": 0.001}}', "meta lacks max_model_len, kv_bytes_per_token"),
])
def test_a_bad_profile_is_named(tmp_path, capsys, content, says):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    line = refused(simulate.main, ["--profile", str(path)], capsys)
    assert says in line and (content is None or str(path) in line)


@pytest.mark.parametrize("lines, says", [
    (['{"prompt_len": 8}', '{"prompt_len": 8,,}'], ":2: JSON is malformed"),
    (['{"prompt_len": 8}', "[1, 2]"], ":2: Expected `object`, got `array`"),
    (['{"output_len": 8}'], ":1: needs one of `prompt` (a list of token ids) and `prompt_len`, not neither"),
    (['{"prompt": [1, 2], "prompt_len": 2}'], ":1: needs one of `prompt` (a list of token ids) and `prompt_len`, "
                                              "not both"),
    (['{"prompt": []}'], ":1: `prompt` is empty"),
    (['{"prompt": [1, -2]}'], ":1: Expected `int` >= 0 - at `$.prompt[1]`"),
    (['{"prompt_len": "abc"}'], ":1: Expected `int | null`, got `str` - at `$.prompt_len`"),
    (['{"prompt_len": 2.5}'], ":1: Expected `int | null`, got `float` - at `$.prompt_len`"),
    (['{"prompt_len": 0}'], ":1: Expected `int` >= 1 - at `$.prompt_len`"),
    (['{"prompt_len": 8, "output_len": -4}'], ":1: Expected `int` >= 1 - at `$.output_len`"),
    (['{"prompt_len": 8, "output_len": 4, "max_tokens": 4}'], ":1: gives both `output_len` and `max_tokens`"),
    (['{"prompt_len": 8, "arrival": "soon"}'], ":1: Expected `float | null`, got `str` - at `$.arrival`"),
    (['{"prompt_len": 8, "arrival": 1e308}'], ":1: Expected `float` <= 1000000000.0 - at `$.arrival`"),
    (['{"prompt_len": 8, "priority": 3}'], ":1: Object contains unknown field `priority`"),
    ([], "no requests in the trace"),
])
def test_a_bad_trace_is_named_with_its_line(profile, tmp_path, capsys, lines, says):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert says in refused(simulate.main, ["--profile", str(profile), "--trace", str(trace)], capsys)


def test_a_trace_is_read_field_by_field(tmp_path):
    """The positive side of the refusals above: each documented field lands where it says."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt": [1, 5, 9], "output_len": 4, "arrival": 2.5, "ttft_slo_ms": 300}\n'
                     '\n'
                     '{"prompt_len": 6, "max_tokens": 7}\n'
                     '{"prompt_len": 2}\n')
    first, second, third = from_trace(str(trace), rate=None, vocab_size=50)
    assert (first.arrival, first.prompt_token_ids, first.output_len, first.ttft_slo_ms) == (2.5, [1, 5, 9], 4, 300.0)
    assert (second.arrival, len(second.prompt_token_ids), second.output_len, second.ttft_slo_ms) == (0.0, 6, 7, 0.0)
    assert second.prompt_token_ids[0] == 1 and all(3 <= t < 50 for t in second.prompt_token_ids[1:])
    assert (third.arrival, len(third.prompt_token_ids), third.output_len) == (0.0, 2, 128)


@pytest.mark.parametrize("flags, says", [
    (["--request-rate", "0"], "--request-rate: must be a rate > 0 (requests per second) or inf, got '0'"),
    (["--request-rate", "-5"], "--request-rate: must be a rate > 0"),
    (["--request-rate", "soon"], "--request-rate: must be a rate > 0"),
    (["--num-prompts", "0"], "--num-prompts: must be at least 1"),
    (["--max-concurrency", "0"], "--max-concurrency: must be at least 1"),
    (["--burstiness", "0"], "--burstiness: must be a number > 0"),
    (["--range-ratio", "1.5"], "--range-ratio: must be in [0, 1), got '1.5'"),
    (["--range-ratio", "1"], "--range-ratio: must be in [0, 1), got '1'"),
    (["--input-len", "5000"], "exceeds max_model_len 512"),
    # a trial: each of these ran and reported something that no server would do
    (["--max-model-len", "100000"], "--max-model-len 100000 exceeds the profile's 512"),
    (["--num-kv-blocks", "1"], "needs more KV cache than the whole cache holds (16 tokens)"),
    (["--slo-admission"], "--slo-admission needs --ttft-slo-ms"),
])
def test_simulate_refuses_workloads_it_cannot_mean(profile, capsys, flags, says):
    assert says in refused(simulate.main, ["--profile", str(profile), *flags], capsys)


def test_bench_refuses_a_range_ratio_outside_its_help_before_any_request(capsys):
    """`shuttle bench --range-ratio 1.5` ran (its --help says r in [0, 1)); refused before it reads the server."""
    assert "--range-ratio: must be in [0, 1), got '1.5'" in refused(
        bench_serve.main, ["--url", "http://127.0.0.1:9", "--range-ratio", "1.5"], capsys)


def test_bench_names_an_unreachable_server_and_an_unreadable_dataset_in_one_line(tmp_path, capsys):
    """Both were tracebacks (aiohttp's ClientConnectorError, FileNotFoundError)."""
    assert "cannot read http://127.0.0.1:9/v1/models (ClientConnectorError" in refused(
        bench_serve.main, ["--url", "http://127.0.0.1:9"], capsys)
    assert "--dataset: cannot read /no/such.jsonl: No such file or directory" in refused(
        bench_serve.main, ["--dataset", "/no/such.jsonl"], capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"max_tokens": 3}\n')
    assert f"--dataset: {bad} line 2: not a {{prompt, max_tokens}} object" in refused(
        bench_serve.main, ["--dataset", str(bad)], capsys)
    bad.write_text('{"prompt": "a", "temperature": 0.5}\n')  # a trial: ignored without a word
    assert "Object contains unknown field `temperature`" in refused(bench_serve.main, ["--dataset", str(bad)], capsys)
    assert "--ttft-slo-ms: must be a number > 0" in refused(bench_serve.main, ["--ttft-slo-ms", "-5"], capsys)


def test_bench_and_simulate_refuse_what_would_lose_the_run_before_it_starts(profile, tmp_path, capsys):
    """A fresh-clone trial: a --result-json or --save-requests that is a directory was a traceback after the whole
    run, its results lost; an empty --dataset ran nothing and exited 0."""
    for flag in ("--result-json", "--save-requests"):
        assert f"{flag}: {tmp_path} is a directory, not a file" in refused(
            bench_serve.main, ["--url", "http://127.0.0.1:9", flag, str(tmp_path)], capsys)
    assert f"--result-json: {tmp_path} is a directory" in refused(
        simulate.main, ["--profile", str(profile), "--result-json", str(tmp_path)], capsys)
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "holds no request" in refused(bench_serve.main, ["--dataset", str(tmp_path / "empty.jsonl")], capsys)


async def test_bench_says_what_the_server_answered_when_it_is_not_the_model_list(capsys):
    """A server with an API key answered 401, and bench said `KeyError: 'data'` and asked whether the server was up."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def models(request):
        return web.json_response({"error": {"message": "bad key"}}, status=401)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")
        said = await asyncio.to_thread(refused, bench_serve.main, ["--url", url], capsys)
    assert "HTTP 401" in said and "bad key" in said, said


def test_the_other_tools_refuse_before_any_work(profile, tmp_path, capsys):
    slos = ["--ttft-slo-ms", "300", "--itl-slo-ms", "50"]
    assert "does not exist" in refused(tune.main, ["--profile", str(profile), "--model", "/no/model", *slos], capsys)
    assert "--budgets: must be at least 1" in refused(
        tune.main, ["--profile", str(profile), "--model", str(MODEL), "--budgets", "0", *slos], capsys)
    assert "--repeats: must be at least 1" in refused(
        calibrate.main, ["--model", str(MODEL), "--out", str(tmp_path / "p.json"), "--repeats", "0"], capsys)
    # a trial: each of these was a traceback, or ran as if the flag had not been given
    tuned = ["--profile", str(profile), "--model", str(MODEL), *slos, "--verify", "0"]
    assert "does not exist" in refused(tune.main, [*tuned, "--model", "/no/model"], capsys)
    assert "--max-num-batched-tokens: tune sweeps it; give the values to try with --budgets" in refused(
        tune.main, [*tuned, "--max-num-batched-tokens", "99"], capsys)
    assert "--max-num-seqs: tune sweeps it; give the values to try with --seqs" in refused(
        tune.main, [*tuned, "--max-num-seqs", "3"], capsys)
    (tmp_path / "file").write_text("")
    assert "--out" in refused(tune.main, [*tuned, "--out", str(tmp_path / "file" / "under")], capsys)
    assert "its folder cannot be made" in refused(
        calibrate.main, ["--model", str(MODEL), "--out", str(tmp_path / "file" / "p.json")], capsys)
    assert "invalid choice: 'bogus'" in refused(
        calibrate.main, ["--model", str(MODEL), "--out", str(tmp_path / "p.json"), "--attention-backend", "bogus"],
        capsys)
    assert "does not exist" in refused(
        compare_inprocess.main, ["--profile", str(profile), "--model", "/no/model"], capsys)
    assert "--load: must be a number > 0" in refused(
        compare_inprocess.main, ["--profile", str(profile), "--model", str(MODEL), "--load", "0"], capsys)


def test_tune_warns_when_the_recommended_rate_is_not_a_found_limit():
    """Met at the highest rate swept: the limit was not found; above the predicted capacity: a run too short to
    queue. Neither: no warning."""
    args = SimpleNamespace(rates=[10.0, 20.0], attainment=0.9, num_prompts=100)
    point = SimpleNamespace(max_num_batched_tokens=512, max_num_seqs=32, rate=20.0, attainment=1.0)
    choice = {"max_num_batched_tokens": 512, "max_num_seqs": 32, "request_rate": 16.0}
    warnings = tune.limit_warnings(args, [point], choice, capacity=15.0)
    assert len(warnings) == 2 and "highest rate swept (20.0" in warnings[0] and "capacity (15.0" in warnings[1]
    point.attainment = 0.5
    assert tune.limit_warnings(args, [point], choice, capacity=None) == []
