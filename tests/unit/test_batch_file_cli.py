"""`shuttle batch`'s own refusals, before anything is sent (a fresh-clone trial): a value the client cannot run with,
an address that is not a ZeroMQ endpoint, and an OUTPUT it cannot append to are one line and exit status 2, never a
traceback or a client that waits forever."""

import json

import pytest

from shuttle.launcher import cli


def batch_input(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": "Hi", "max_tokens": 2}}) + "\n")
    return path


@pytest.mark.parametrize("flags, words", [
    (["--max-in-flight", "0"], "--max-in-flight: must be at least 1, got 0"),
    (["--endpoint", "notanendpoint"], "'notanendpoint' is not a ZeroMQ endpoint"),
    (["--endpoint", "http://127.0.0.1:8000"], "is not a ZeroMQ endpoint"),
    (["--endpoint", "tcp://127.0.0.1:99999"], "is not a ZeroMQ endpoint"),
    (["--server-timeout", "0"], "--server-timeout"),
])
def test_a_flag_the_client_cannot_run_with_is_a_usage_error(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["batch", str(batch_input(tmp_path)), str(tmp_path / "out.jsonl"), *flags])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("output", ["", "missing/out.jsonl"])  # a directory; a folder that does not exist
def test_an_output_it_cannot_append_to_is_one_line_before_anything_is_sent(tmp_path, capsys, output):
    code = cli.main(["batch", str(batch_input(tmp_path)), str(tmp_path / output), "--endpoint",
                     "tcp://127.0.0.1:9", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("shuttle batch: cannot append to OUTPUT") and len(err.splitlines()) == 1


def test_an_input_that_is_not_utf8_names_the_file(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_bytes(b"\xff\xfe{}\n")
    assert cli.main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--quiet"]) == 2
    assert f"shuttle batch: {tmp_path / 'in.jsonl'}: " in capsys.readouterr().err
