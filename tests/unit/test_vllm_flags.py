"""docs/vllm-flags.md against `shuttle serve`'s parser, in process: every flag the table marks same or alias is listed
in `shuttle serve --help`; every flag it marks accepted is listed there too, takes the values that name what shuttle
does and refuses another by name; every flag it marks refused exits 2 with a line naming it and saying shuttle does not
implement it (never "unrecognized arguments", never taken). Every refusal of one command line is in one message. The
issue's production command line parses into the ShuttleConfig it asks for, and --hf-overrides reaches the launcher's,
the frontend's and the worker's view of config.json. Also --config FILE.yaml, --chat-template given inline, vLLM's
JSON --allowed-origins and --log-level."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from shuttle.common.config import IpcConfig, ShuttleConfig
from shuttle.common.errors import ModelDirError
from shuttle.common.model_config import ModelConfig, apply_hf_overrides
from shuttle.launcher import cli
from shuttle.launcher.model_args import resolve_model_args
from shuttle.launcher.vllm_flags import REFUSED_FLAGS, TAKEN_FLAGS
from tests.server import MODEL_DIR, REPO

TABLE = Path(__file__).resolve().parents[2] / "docs" / "vllm-flags.md"
SERVE_HELP = cli._command_parser(cli.build_parser(), "serve").format_help()


def _rows() -> list[tuple[str, str]]:
    """(flag, status) of each table row, one per flag its first cell names."""
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("same", "alias", "accepted", "refused"):
            rows += [(flag, cells[1]) for flag in re.findall(r"`(-[-\w.]+)`", cells[0])]
    return rows


ROWS = _rows()


# The production `vllm serve` line (issue 43, acceptance 2), after MODEL; P, T and DIR are filled in
PRODUCTION_LINE = ("--host 127.0.0.1 --port P --max-model-len 512 --gpu-memory-utilization 0.9 --enable-prefix-caching "
                   "--max-num-seqs 64 --max-num-batched-tokens 2048 --enable-chunked-prefill --enable-auto-tool-choice "
                   "--tool-call-parser hermes --api-key secret --served-model-name my-model --disable-log-requests "
                   "--uvicorn-log-level warning --dtype auto --seed 0 --chat-template T --response-role assistant "
                   "--kv-cache-dtype auto --swap-space 4 --tensor-parallel-size 1 --pipeline-parallel-size 1 "
                   "--generation-config auto --max-logprobs 20 --disable-fastapi-docs --enable-prompt-tokens-details "
                   "--enable-force-include-usage --structured-outputs-config.backend xgrammar "
                   "--reasoning-parser deepseek_r1 --block-size 16 --max-num-partial-prefills 1 "
                   "--limit-mm-per-prompt '{\"image\":0}' --trust-remote-code --download-dir DIR --load-format auto "
                   "--config-format auto --tokenizer-mode auto --max-lora-rank 16")
CHAT_TEMPLATE = str(REPO / "tests" / "data" / "stories_chat.jinja")


def production_argv(port: str, template: str, download_dir: str) -> list[str]:
    """PRODUCTION_LINE's arguments with P, T and DIR given."""
    fill = {"P": port, "T": template, "DIR": download_dir}
    return [fill.get(token, token) for token in shlex.split(PRODUCTION_LINE)]


def test_the_table_covers_the_most_used_flags_and_the_production_line():
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
                 "--scheduling-policy", "--async-scheduling", "--hf-overrides", "--uds",
                 "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint", "--enable-request-id-headers",
                 "--show-hidden-metrics-for-version", "--reasoning-parser", "--enable-prompt-tokens-details",
                 "--enable-force-include-usage", "--disable-fastapi-docs", "--pipeline-parallel-size", "-pp",
                 "--load-format", "--tokenizer-mode", "--config-format", "--structured-outputs-config.backend",
                 "--limit-mm-per-prompt", "--max-lora-rank"):
        assert flag in listed, flag
    assert {t for t in production_argv("0", "T", "DIR") if t.startswith("-")} <= listed
    assert {flag for flag, status in ROWS if status == "refused"} == set(REFUSED_FLAGS)
    assert {flag for flag, status in ROWS if status == "accepted"} == {
        name for flag, taken in TAKEN_FLAGS.items() for name in (flag, *taken.aliases)}


def test_the_doc_shows_the_production_line():
    text = TABLE.read_text()
    block = text[text.index("```bash\nshuttle serve MODEL"):]
    block = block[len("```bash\nshuttle serve MODEL"):block.index("```", 3)].replace("\\\n", " ")
    assert shlex.split(block) == production_argv("8000", "template.jinja", "/models/cache")


@pytest.mark.parametrize("flag", [flag for flag, status in ROWS if status != "refused"])
def test_a_flag_marked_same_is_in_serve_help(flag):
    assert re.search(rf"(^|[\s,\[]){re.escape(flag)}([\s,=\]]|$)", SERVE_HELP, re.M), flag


@pytest.mark.parametrize("flag", [flag for flag, status in ROWS if status == "refused"])
def test_a_flag_marked_refused_exits_2_naming_it(flag, capsys):
    assert not re.search(rf"^  {re.escape(flag)}[\s,]", SERVE_HELP, re.M)  # no option of --help
    for argv in ([flag], [flag, "x"], [str(MODEL_DIR), flag, "x"]):
        with pytest.raises(SystemExit) as exit_:
            cli.build_parser().parse_args(["serve", *argv])
        assert exit_.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"shuttle serve: error: {flag}: shuttle does not implement it: "), line
        assert "unrecognized" not in line


# accepted flag -> (the values it takes, a value it refuses or None: it takes every well-formed value)
ACCEPTED = {
    "--load-format": (["auto", "safetensors"], "pt"),
    "--tokenizer-mode": (["auto", "hf"], "mistral"),
    "--config-format": (["auto", "hf"], "mistral"),
    "--structured-outputs-config.backend": (["xgrammar", "auto"], "guidance"),
    "--structured-outputs-config": (['{"backend": "xgrammar"}', '{"backend": "auto"}', "{}"],
                                    '{"backend": "xgrammar", "disable_fallback": true}'),
    "--limit-mm-per-prompt": (['{"image":0}', '{"image": 0, "video": 0}', '{"image": {"count": 0}}', "{}"],
                              '{"image":0,"audio":1}'),
    "--pipeline-parallel-size": (["1"], "2"),
    "-pp": (["1"], "4"),
    "--show-hidden-metrics-for-version": (["0.10", "v0.11.1"], None),
    "--swap-space": (["4", "0", "16", "2.5"], None),
    "--cpu-offload-gb": (["0", "0.0"], "8"),
    "--response-role": (["assistant"], "user"),
    "--max-num-partial-prefills": (["1"], "4"),
    "--allowed-methods": (['["*"]', "*", '[ "*" ]'], '["GET"]'),
    "--allowed-headers": (['["*"]', "*"], "not json"),
}


def _refusal_lines(argv: list[str], capsys) -> list[str]:
    """The error lines `shuttle serve ARGV` exits 2 with (the usage lines before them left out)."""
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", str(MODEL_DIR), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    return err[next(i for i, line in enumerate(err) if ": error: " in line):]


def test_a_refusal_prints_a_one_line_usage_not_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", str(MODEL_DIR), "--ssl-certfile", "cert.pem"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("usage: shuttle serve [options] MODEL\nshuttle serve: error: --ssl-certfile: "
                                       "shuttle does not implement it: TLS is not implemented: terminate it "
                                       "in a reverse proxy\n")


@pytest.mark.parametrize("flag", [flag for flag, status in ROWS if status == "accepted"])
def test_a_flag_marked_accepted_takes_what_shuttle_does_and_refuses_the_rest(flag, capsys):
    takes, refuses = ACCEPTED[flag]
    long_name = next(f for f, taken in TAKEN_FLAGS.items() if flag in (f, *taken.aliases))
    assert TAKEN_FLAGS[long_name].help.split(",")[0] in " ".join(SERVE_HELP.split())  # --help says what it takes
    dest = long_name.lstrip("-").replace("-", "_").replace(".", "_")
    for value in takes:
        args = cli.build_parser().parse_args(["serve", flag, value, str(MODEL_DIR)])
        assert args.model_dir == str(MODEL_DIR) and getattr(args, dest) == value
    assert not hasattr(cli.build_parser().parse_args(["serve", str(MODEL_DIR)]), dest)
    if refuses is not None:
        assert _refusal_lines([flag, refuses], capsys) == [
            f"shuttle serve: error: {long_name} {refuses}: shuttle does not implement it: "
            f"{TAKEN_FLAGS[long_name].refusal(refuses)}"]


@pytest.mark.parametrize("argv, line", [
    (["--swap-space", "lots"], "--swap-space: 'lots' is not a number >= 0"),
    (["--swap-space", "-1"], "--swap-space: '-1' is not a number >= 0"),
    (["--pipeline-parallel-size", "one"], "--pipeline-parallel-size: 'one' is not an integer >= 0"),
    (["--limit-mm-per-prompt", "image=0"], "--limit-mm-per-prompt: 'image=0' is not a JSON object"),
    (["--limit-mm-per-prompt", '{"image": "none"}'], "--limit-mm-per-prompt: 'image': \"none\" is not a count"),
])
def test_a_malformed_value_of_an_accepted_flag_is_a_usage_error(argv, line, capsys):
    assert _refusal_lines(argv, capsys) == [f"shuttle serve: error: {line}"]


@pytest.mark.parametrize("argv, words", [
    (["--seed", str(2**64)], "--seed: must fit in 64 bits"),  # the worker's generator took it and crashed
    (["--seed", str(-(2**63) - 1)], "--seed: must fit in 64 bits"),
    (["--max-logprobs", "-2"], "--max-logprobs: must be -1 (no cap) or at least 0"),
    (["--batch-endpoint", "notanendpoint"], "'notanendpoint' is not a ZeroMQ endpoint"),  # bound only after the load
    (["--engine-endpoint", "10.0.0.3:7100"], "'10.0.0.3:7100' is not a ZeroMQ endpoint"),
    (["--served-model-name", ""], "a served model name must not be empty"),  # served under the model's name
    (["--served-model-name", "a", " b"], "a served model name must not be empty or start or end with whitespace"),
])
def test_a_value_a_child_process_could_not_take_is_refused_by_the_parser(argv, words, capsys):
    [line] = _refusal_lines(argv, capsys)
    assert words in line, line


def test_max_logprobs_minus_one_is_vllms_no_cap_and_the_vocabulary_bounds_a_request():
    from shuttle.common.errors import InvalidRequestError
    from shuttle.common.sampling import SamplingParams

    assert cli.build_parser().parse_args(["serve", "--max-logprobs", "-1", "--seed", str(2**64 - 1)]).max_logprobs == -1
    SamplingParams(logprobs=512, prompt_logprobs=512).validate(512, -1)
    for params in (SamplingParams(logprobs=513), SamplingParams(prompt_logprobs=513)):
        for cap in (-1, 100_000):  # a cap above the vocabulary: the worker's top-k cannot list more than it
            with pytest.raises(InvalidRequestError, match=r"must be in \[0, 512\]"):
                params.validate(512, cap)


def test_every_refusal_of_a_command_line_is_in_one_message(capsys):
    lines = _refusal_lines(["--swap-space", "4", "--load-format", "pt", "--ssl-certfile", "c.pem", "--no-such-flag",
                            "--max-num-seqs", "8", "--pipeline-parallel-size", "2", "--no-enable-chunked-prefill",
                            "--ssl-keyfile", "k.pem"], capsys)
    assert lines[0] == "shuttle serve: error: 6 problems, all of them refused before anything started:"
    assert lines[1:] == [
        "  --load-format pt: shuttle does not implement it: transformers loads the checkpoint's safetensors or "
        "pytorch_model.bin (taken: auto, safetensors)",
        "  --ssl-certfile: shuttle does not implement it: TLS is not implemented: terminate it in a reverse proxy",
        "  --pipeline-parallel-size 2: shuttle does not implement it: one pipeline stage: spread a model with "
        "--tensor-parallel-size, replicate it with -dp (taken: 1)",
        "  --no-enable-chunked-prefill: shuttle does not implement it: shuttle always prefills long prompts in chunks "
        "within --max-num-batched-tokens (set it to the longest prompt to prefill each in one step)",
        "  --ssl-keyfile: shuttle does not implement it: TLS is not implemented: terminate it in a reverse proxy",
        "  unrecognized arguments: --no-such-flag"]


def test_chunked_prefill_is_taken_on_and_refused_off_by_name(capsys):
    assert cli.build_parser().parse_args(["serve", str(MODEL_DIR), "--enable-chunked-prefill"]).enable_chunked_prefill
    assert _refusal_lines(["--no-enable-chunked-prefill"], capsys) == [
        "shuttle serve: error: --no-enable-chunked-prefill: shuttle does not implement it: shuttle always prefills "
        "long prompts in chunks within --max-num-batched-tokens (set it to the longest prompt to prefill each in one "
        "step)"]


def test_refusals_and_a_bad_value_of_another_flag_are_one_message(capsys):
    assert _refusal_lines(["--ssl-keyfile", "k.pem", "--max-num-seqs", "many"], capsys) == [
        "shuttle serve: error: 2 problems, all of them refused before anything started:",
        "  --ssl-keyfile: shuttle does not implement it: TLS is not implemented: terminate it in a reverse proxy",
        "  argument --max-num-seqs: invalid positive value: 'many'"]


def test_unknown_flags_alone_are_argparses_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", str(MODEL_DIR), "--no-such-flag", "--swap-space", "4"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "shuttle: error: unrecognized arguments: --no-such-flag"


def test_the_refusals_of_a_config_file_and_the_command_line_are_one_message(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("ssl_keyfile: k.pem\ntokenizer-mode: slow\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", str(MODEL_DIR), "--config", str(config), "--response-role", "user"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-4:] == [
        "shuttle serve: error: 3 problems, all of them refused before anything started:",
        "  --ssl-keyfile: shuttle does not implement it: TLS is not implemented: terminate it in a reverse proxy",
        "  --tokenizer-mode slow: shuttle does not implement it: prompts are tokenized with the model's "
        "tokenizer.json (taken: auto, hf)",
        "  --response-role user: shuttle does not implement it: chat responses always have the role assistant "
        "(taken: assistant)"]


def test_the_production_command_line_parses_into_its_config(tmp_path):
    args = cli.build_parser().parse_args(["serve", str(MODEL_DIR),
                                          *production_argv("8123", CHAT_TEMPLATE, str(tmp_path))])
    resolve_model_args(args)
    config = ShuttleConfig.from_args(args, IpcConfig.in_directory(str(tmp_path)))
    model = config.model
    assert (model.max_model_len, model.served_model_names, model.dtype, model.seed, model.max_logprobs,
            model.trust_remote_code, model.hf_overrides) == (512, ("my-model",), "auto", 0, 20, True, {})
    assert (config.host, config.port, config.chat_template) == ("127.0.0.1", 8123, CHAT_TEMPLATE)
    assert (config.cache.gpu_memory_utilization, config.cache.enable_prefix_caching, config.cache.block_size,
            config.cache.kv_cache_dtype) == (0.9, True, 16, "auto")
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 2048)
    assert (config.tool_calls.enable_auto_tool_choice, config.tool_calls.tool_call_parser) == (True, "hermes")
    assert config.observability.enable_log_requests is False
    assert config.parallel.tensor_parallel_size == 1
    api = config.api
    assert (api.uvicorn_log_level, api.disable_fastapi_docs, api.enable_prompt_tokens_details,
            api.enable_force_include_usage, api.reasoning_parser) == ("warning", True, True, True, "deepseek_r1")
    assert (args.api_key, args.download_dir, args.generation_config) == ("secret", str(tmp_path), "auto")
    assert (args.swap_space, args.pipeline_parallel_size, args.max_num_partial_prefills, args.max_lora_rank,
            args.load_format, args.config_format, args.tokenizer_mode, args.structured_outputs_config_backend,
            args.limit_mm_per_prompt, args.response_role) == (
        "4", "1", "1", 16, "auto", "auto", "auto", "xgrammar", '{"image":0}', "assistant")


def test_refused_in_shuttle_engine_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["engine", "--listen", "tcp://127.0.0.1:7100", "--ssl-keyfile", "k.pem"])
    assert exit_.value.code == 2 and "--ssl-keyfile: shuttle does not implement it" in capsys.readouterr().err


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


def test_a_config_files_model_key_is_the_model_unless_the_command_line_names_one(tmp_path):
    """A trial: MODEL on the command line beside a file's `model` was refused as a disagreement, where every other
    flag of the command line wins over the file's."""
    config = tmp_path / "serve.yaml"
    config.write_text("model: acme/not-this-one\n")
    typed = tmp_path / "typed"  # the default model under another name: a MODEL typed, not the default
    typed.symlink_to(MODEL_DIR)
    for argv in (["serve", "--config", str(config), str(typed)], ["serve", str(typed), "--config", str(config)],
                 ["serve", "--config", str(config), "--model", str(typed)]):
        args = _parsed(argv)
        resolve_model_args(args)
        assert args.model == str(typed), argv
    config.write_text(f"model: {MODEL_DIR}\n")
    args = _parsed(["serve", "--config", str(config)])
    resolve_model_args(args)
    assert (args.model, args.model_dir) == ("stories260K", str(MODEL_DIR))  # the default model's served name


@pytest.mark.parametrize("text, words", [
    ("max-num-seqs: 4\nno-such-flag: 1\n", "unknown key 'no-such-flag'"),
    ("config: other.yaml\n", "key 'config' is not taken in a config file (--config only on the command line)"),
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
    config.write_text("ssl_keyfile: k.pem\n")
    with pytest.raises(SystemExit) as exit_:
        _parsed(["serve", "--config", str(config)])
    assert exit_.value.code == 2 and "--ssl-keyfile: shuttle does not implement it" in capsys.readouterr().err
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


@pytest.mark.parametrize("broken", ["{% if x %}{{ messages[0].content ", "{{ x | no_such_filter }}"])
def test_a_chat_template_that_does_not_compile_is_refused_at_start_up(tmp_path, capsys, broken):
    """A fresh-clone trial: a broken template started the server, and every chat request then got a 400 blaming
    the client's messages. Inline or in a file, it is refused by the command line, with Jinja's reason."""
    file = tmp_path / "broken.jinja"
    file.write_text(broken)
    for value in (broken, str(file)):
        with pytest.raises(SystemExit) as exit_:
            cli.build_parser().parse_args(["serve", "--chat-template", value])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and "is no valid Jinja template" in err and "(line 1)" in err, err


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
    monkeypatch.setattr("shuttle.launcher.commands.serve",
                        lambda args: started.append(os.environ["SHUTTLE_LOG_LEVEL"]) or 0)
    monkeypatch.setenv("SHUTTLE_LOG_LEVEL", "warning")
    assert cli.main(["serve", str(MODEL_DIR)]) == 0
    assert cli.main(["serve", str(MODEL_DIR), "--log-level", "DEBUG"]) == 0
    assert started == ["WARNING", "DEBUG"]
    monkeypatch.setenv("SHUTTLE_LOG_LEVEL", "loud")
    assert cli.main(["serve", str(MODEL_DIR)]) == 2
    assert "$SHUTTLE_LOG_LEVEL 'loud'" in capsys.readouterr().err


def _served_config(tmp_path, *flags: str) -> ShuttleConfig:
    args = cli.build_parser().parse_args(["serve", str(MODEL_DIR), *flags])
    resolve_model_args(args)
    return ShuttleConfig.from_args(args, IpcConfig.in_directory(str(tmp_path)))


def test_hf_overrides_reach_every_process_and_set_the_context_limit(tmp_path):
    config = _served_config(tmp_path, "--hf-overrides", '{"max_position_embeddings": 256}')
    assert config.model.max_model_len == 256  # config.json says 512: the --max-model-len default follows the override
    handed = ShuttleConfig.from_json(config.to_json()).model  # what the frontend and every worker are given
    assert handed.hf_overrides == {"max_position_embeddings": 256}
    assert handed.hf_config()["max_position_embeddings"] == 256 and handed.max_model_len == 256
    assert _served_config(tmp_path).model.max_model_len == 512
    with pytest.raises(ModelDirError, match=r"--max-model-len 512 is outside 1\.\.256"):
        _served_config(tmp_path, "--max-model-len", "512", "--hf-overrides", '{"max_position_embeddings": 256}')


def test_the_worker_builds_its_model_from_the_overridden_config(tmp_path):
    from shuttle.common.config import CacheConfig, WorkerConfig
    from shuttle.worker.worker import ModelRunner
    model = ModelConfig.from_dir(MODEL_DIR, hf_overrides={"max_position_embeddings": 256, "rms_norm_eps": 0.5})
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory(str(tmp_path)), cache=CacheConfig(16, 8),
                           worker=WorkerConfig(device="cpu"))
    hf = ModelRunner(config).model.config
    assert (hf.max_position_embeddings, hf.rms_norm_eps, hf.hidden_size) == (256, 0.5, 64)


@pytest.mark.parametrize("flags", [[], ["--max-model-len", "32"]])  # alone it said "names no context limit"
def test_an_hf_override_of_another_type_is_one_line_before_any_process(flags, no_launch, capsys):
    argv = ["serve", str(MODEL_DIR), "--port", "0", "--device", "cpu",
            "--hf-overrides", '{"max_position_embeddings": "abc"}', *flags]
    assert cli.main(argv) == 2  # the worker used to exit 1 with a 37-line traceback
    assert capsys.readouterr().err == ('shuttle: error: --hf-overrides: max_position_embeddings must be an integer as '
                                       'in config.json (512), got a string ("abc")\n')


@pytest.mark.parametrize("override, why", [
    ({"num_attention_heads": 7}, "validate_architecture"),
    ({"rope_scaling": {"rope_type": "linear"}}, "Missing required keys in `rope_parameters` for 'rope_type'='linear'"),
])
def test_an_hf_override_the_config_class_refuses_is_one_line_at_start(override, why, tmp_path):
    with pytest.raises(ModelDirError, match=re.escape("--hf-overrides: transformers' llama configuration refuses the "
                                                      "overridden config.json: ")) as refused:
        _served_config(tmp_path, "--hf-overrides", json.dumps(override))
    assert why in str(refused.value) and "\n" not in str(refused.value)


def test_hf_override_types_are_checked_nested_too():
    base = {"rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_scaling": None,
            "text_config": {"model_type": "llama", "max_position_embeddings": 512}}
    assert apply_hf_overrides(base, {"rms_norm_eps": 1, "rope_scaling": {"factor": 2.0}, "new_key": "x"}) == {
        **base, "rms_norm_eps": 1, "rope_scaling": {"factor": 2.0}, "new_key": "x"}  # an integer for a number
    for overrides, message in (({"tie_word_embeddings": 1}, "tie_word_embeddings must be a boolean"),
                               ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number"),
                               ({"text_config": {"max_position_embeddings": 2.5}},
                                "text_config.max_position_embeddings must be an integer as in config.json (512), got "
                                "a number (2.5)"),
                               ({"text_config": {"max_position_embeddings": 0}},  # a trial: -1 layers failed late
                                "text_config.max_position_embeddings is a count or size, at least 1 (config.json: "
                                "512), got 0")):
        with pytest.raises(ModelDirError, match=re.escape(f"--hf-overrides: {message}")):
            apply_hf_overrides(base, overrides)


def test_hf_overrides_merge_as_vllms_do():
    base = {"model_type": "llava", "rope_scaling": {"type": "linear", "factor": 2.0},
            "text_config": {"model_type": "llama", "max_position_embeddings": 512,
                            "rope_scaling": {"type": "linear", "factor": 1.0}}}
    merged = apply_hf_overrides(base, {"rope_scaling": {"factor": 4.0}, "vocab_size": 7,
                                       "text_config": {"max_position_embeddings": 256, "rope_scaling": {"factor": 3}}})
    assert merged == {"model_type": "llava", "rope_scaling": {"factor": 4.0}, "vocab_size": 7,  # replaced whole
                      "text_config": {"model_type": "llama", "max_position_embeddings": 256,  # a nested config: merged
                                      "rope_scaling": {"type": "linear", "factor": 3}}}
    assert base["text_config"]["max_position_embeddings"] == 512 and base["rope_scaling"]["factor"] == 2.0


@pytest.mark.parametrize("value", ["[1]", "max_position_embeddings=256", '"x"'])
def test_hf_overrides_must_be_a_json_object(value, capsys):
    assert _refusal_lines(["--hf-overrides", value], capsys) == [
        f"shuttle serve: error: argument --hf-overrides: not a JSON object: {value!r}"]


def test_load_format_safetensors_needs_safetensors_weights(tmp_path, monkeypatch, capsys):
    model = tmp_path / "bin-model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, model / name)
    import torch
    torch.save({"w": torch.zeros(1)}, model / "pytorch_model.bin")
    started = []
    monkeypatch.setattr("shuttle.launcher.commands.serve", lambda args: started.append(args.load_format) or 0)
    assert cli.main(["serve", str(model), "--load-format", "safetensors"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"shuttle: error: --load-format safetensors: {model} has no model.safetensors or "
        f"model.safetensors.index.json (--load-format auto loads its pytorch_model.bin)")
    assert cli.main(["serve", str(model), "--load-format", "auto"]) == 0
    assert cli.main(["serve", str(MODEL_DIR), "--load-format", "safetensors"]) == 0
    assert started == ["auto", "safetensors"]


def test_the_docs_refusal_example_is_what_the_parser_prints(capsys):
    text = TABLE.read_text()
    example = text[text.index("`--swap-space 4 --pipeline-parallel-size 2"):]
    argv = example[1:example.index("`", 1)].split()
    block = example[example.index("```text\n") + 8:]
    printed = block[:block.index("```")].splitlines()
    assert printed[0] == "usage: shuttle serve [options] MODEL"
    assert _refusal_lines(argv, capsys) == printed[1:]
