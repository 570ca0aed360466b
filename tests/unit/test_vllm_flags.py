"""docs/vllm-flags.md against `shuttle serve`'s parser, in process: every flag the table marks same or alias is listed
in `shuttle serve --help`; every flag it marks refused exits 2 with a line naming it and saying shuttle does not
implement it (never "unrecognized arguments", never taken). Also --config FILE.yaml, --chat-template given inline,
vLLM's JSON --allowed-origins and --log-level."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shuttle.launcher import cli
from shuttle.launcher.vllm_flags import REFUSED_FLAGS
from tests.server import MODEL_DIR

TABLE = Path(__file__).resolve().parents[2] / "docs" / "vllm-flags.md"
SERVE_HELP = cli._command_parser(cli.build_parser(), "serve").format_help()


def _rows() -> list[tuple[str, str]]:
    """(flag, status) of each table row, one per flag its first cell names."""
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("same", "alias", "refused"):
            rows += [(flag, cells[1]) for flag in re.findall(r"`(-[-\w]+)`", cells[0])]
    return rows


ROWS = _rows()


def test_the_table_covers_the_most_used_flags():
    listed = {flag for flag, _ in ROWS}
    for flag in ("--model", "--tokenizer", "--revision", "--download-dir", "--trust-remote-code", "--dtype",
                 "--max-model-len", "--gpu-memory-utilization", "--kv-cache-dtype", "--max-num-seqs",
                 "--max-num-batched-tokens", "--enable-chunked-prefill", "--enable-prefix-caching",
                 "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--seed", "--served-model-name",
                 "--chat-template", "--generation-config", "--config", "--api-key", "--host", "--port",
                 "--allowed-origins", "--max-logprobs", "--enable-auto-tool-choice", "--tool-call-parser",
                 "--disable-log-requests", "--enable-log-requests", "--disable-log-stats", "--quantization",
                 "--enforce-eager", "--block-size", "--swap-space", "--cpu-offload-gb", "--speculative-config",
                 "--lora-modules", "--enable-lora", "--uvicorn-log-level", "--root-path", "--ssl-keyfile",
                 "--ssl-certfile", "--response-role", "--return-tokens-as-token-ids", "--max-num-partial-prefills",
                 "--scheduling-policy", "--async-scheduling"):
        assert flag in listed, flag
    assert {flag for flag, status in ROWS if status == "refused"} == set(REFUSED_FLAGS)


@pytest.mark.parametrize("flag", [flag for flag, status in ROWS if status != "refused"])
def test_a_flag_marked_same_is_in_serve_help(flag):
    assert re.search(rf"(^|[\s,\[]){re.escape(flag)}([\s,=\]]|$)", SERVE_HELP, re.M), flag


@pytest.mark.parametrize("flag", [flag for flag, status in ROWS if status == "refused"])
def test_a_flag_marked_refused_exits_2_naming_it(flag, capsys):
    assert flag not in SERVE_HELP
    for argv in ([flag], [flag, "x"], [str(MODEL_DIR), flag, "x"]):
        with pytest.raises(SystemExit) as exit_:
            cli.build_parser().parse_args(["serve", *argv])
        assert exit_.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"shuttle serve: error: {flag}: shuttle does not implement it: "), line
        assert "unrecognized" not in line


def test_the_value_that_asks_for_what_shuttle_does_is_taken():
    for flag, value in (("--swap-space", "0"), ("--cpu-offload-gb", "0"), ("--response-role", "assistant")):
        args = cli.build_parser().parse_args(["serve", flag, value, str(MODEL_DIR)])
        assert args.model_dir == str(MODEL_DIR) and not hasattr(args, "refused_flag")


def test_refused_in_shuttle_engine_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["engine", "--listen", "tcp://127.0.0.1:7100", "--speculative-config", "{}"])
    assert exit_.value.code == 2 and "--speculative-config: shuttle does not implement it" in capsys.readouterr().err


def _parsed(argv: list[str]):
    parser = cli.build_parser()
    return parser.parse_args(cli.expand_config_file(argv, cli._command_parser(parser, argv[0])))


def test_a_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 32k\nmax_num_seqs: 7\nserved-model-name: [a, b]\nenable_prefix_caching: false\n"
                      "trust-remote-code: true\nallowed-origins: ['https://a.example', 'https://b.example']\n"
                      "engine-endpoint: [tcp://10.0.0.1:7100, tcp://10.0.0.2:7100]\nport: 9000\n"
                      "generation_config: vllm\n")
    args = _parsed(["serve", str(MODEL_DIR), "--config", str(config), "--max-num-seqs", "3"])
    assert (args.model_dir, args.max_model_len, args.max_num_seqs, args.served_model_name, args.port) == (
        str(MODEL_DIR), 32000, 3, ["a", "b"], 9000)
    assert args.enable_prefix_caching is False and args.trust_remote_code is True
    assert args.allowed_origins == ("https://a.example", "https://b.example")
    assert args.engine_endpoint == ["tcp://10.0.0.1:7100", "tcp://10.0.0.2:7100"]
    assert args.generation_config == "vllm"
    args = _parsed(["serve", "--config", str(config), str(MODEL_DIR), "--served-model-name", "c"])
    assert (args.model_dir, args.served_model_name) == (str(MODEL_DIR), ["c"])


def test_a_config_files_model_key_is_the_model(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {MODEL_DIR}\n")
    assert _parsed(["serve", "--config", str(config)]).model_option == str(MODEL_DIR)


@pytest.mark.parametrize("text, words", [
    ("max-num-seqs: 4\nno-such-flag: 1\n", "unknown key 'no-such-flag'"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("- a\n- b\n", "must be a mapping"),
    ("trust-remote-code: 1\n", "is a switch"),
    ("a: [\n", "not YAML"),
])
def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path, capsys, text, words):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    assert cli.main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and str(config) in err, err


def test_a_refused_flag_in_a_config_file_is_refused(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("enable_lora: true\n")
    with pytest.raises(SystemExit) as exit_:
        _parsed(["serve", "--config", str(config)])
    assert exit_.value.code == 2 and "--enable-lora: shuttle does not implement it" in capsys.readouterr().err
    config.write_text("swap-space: 0\n")
    assert _parsed(["serve", "--config", str(config)]).model_dir is not None


def test_a_config_file_that_is_missing_is_one_line(tmp_path, capsys):
    assert cli.main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path, capsys):
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0]['content'] }}")
    assert cli.build_parser().parse_args(["serve", "--chat-template", str(file)]).chat_template == str(file)
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert cli.build_parser().parse_args(["serve", "--chat-template", inline]).chat_template == inline
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", "--chat-template", str(tmp_path / "missing.jinja")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "neither a file nor a Jinja template" in err


def test_an_inline_chat_template_renders(tmp_path):
    from shuttle.frontend.request.chat_template import ChatTemplate
    from shuttle.frontend.request.protocol import ChatMessage
    template = ChatTemplate(str(MODEL_DIR), "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert template.render([ChatMessage(role="user", content="hi")]) == "<user>hi"


def test_allowed_origins_takes_vllms_json_list_and_shuttles_comma_list(capsys):
    parse = cli.build_parser().parse_args
    json_form = parse(["serve", "--allowed-origins", '["https://a.example", "https://b.example"]'])
    assert json_form.allowed_origins == ("https://a.example", "https://b.example")
    assert parse(["serve", "--allowed-origins", "https://a.example,https://b.example"]).allowed_origins == (
        "https://a.example", "https://b.example")
    assert parse(["serve", "--allowed-origins", '["*"]']).allowed_origins == ("*",)
    with pytest.raises(SystemExit):
        parse(["serve", "--allowed-origins", '["https://a.example", 3]'])
    assert "not a JSON list of origins" in capsys.readouterr().err


def test_log_level_flag_and_environment(monkeypatch, capsys):
    started = []
    monkeypatch.setattr("shuttle.launcher.launcher.serve",
                        lambda args: started.append(os.environ["SHUTTLE_LOG_LEVEL"]) or 0)
    monkeypatch.setenv("SHUTTLE_LOG_LEVEL", "warning")
    assert cli.main(["serve", str(MODEL_DIR)]) == 0
    assert cli.main(["serve", str(MODEL_DIR), "--log-level", "DEBUG"]) == 0
    assert started == ["WARNING", "DEBUG"]
    monkeypatch.setenv("SHUTTLE_LOG_LEVEL", "loud")
    assert cli.main(["serve", str(MODEL_DIR)]) == 2
    assert "$SHUTTLE_LOG_LEVEL 'loud'" in capsys.readouterr().err
