"""Every config field declared with `option` is a `shuttle serve` flag and reaches the config by name."""

import dataclasses

import pytest

from shuttle.common.config import SERVE_SECTIONS, CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig
from shuttle.common.speculative import SpeculativeConfig
from shuttle.launcher import cli
from shuttle.launcher.cli import build_parser
from tests.server import MODEL_DIR

# a value other than the default for each field, as it is typed on the command line
NON_DEFAULTS = {
    "block_size": ("8", 8), "num_kv_blocks": ("100", 100), "kv_cache_memory": ("2MiB", 2 * 2**20),
    "kv_cache_dtype": ("bfloat16", "bfloat16"),
    "max_num_seqs": ("7", 7), "max_num_batched_tokens": ("300", 300), "max_waiting_requests": ("9", 9),
    "scheduling_policy": ("priority", "priority"), "priority_aging_seconds": ("2.5", 2.5),
    "request_timeout": ("4", 4.0), "max_seqs_per_request": ("3", 3), "long_prefill_token_threshold": ("64", 64),
    "ttft_slo_ms": ("250", 250.0), "step_cost_profile": ("", ""), "step_log": ("/dev/null", "/dev/null"),
    "attention_backend": ("reference", "reference"), "device": ("CUDA:1", "cuda:1"),
    "quantization": ("int8", "int8"),  # refused with CUDA and -tp 2 later, by resolve_config
    "gpu_memory_utilization": ("0.5", 0.5),
    "worker_threads": ("1", 1), "worker_cores": ("3,0-2", "0-3"), "step_timeout": ("5", 5.0),
    "heartbeat_timeout": ("6", 6.0),
    "max_restarts": ("2", 2), "shutdown_timeout": ("3", 3.0), "keep_alive_timeout": ("1", 1.0),
    "header_timeout": ("2", 2.0), "body_timeout": ("3", 3.0), "max_batch_message_bytes": ("1KiB", 1024),
    "tensor_parallel_size": ("2", 2), "master_addr": ("127.0.0.2", "127.0.0.2"), "master_port": ("29500", 29500),
    "tool_call_parser": ("llama3_json", "llama3_json"),
    "uds": ("/tmp/s.sock", "/tmp/s.sock"), "root_path": ("/llm", "/llm"), "uvicorn_log_level": ("WARNING", "warning"),
    "reasoning_parser": ("qwen3", "qwen3"), "metric_prefix": ("vllm", "vllm"),
    "responses_store_max_entries": ("7", 7), "responses_store_max_age": ("60", 60.0),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2}',
                           SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=5,
                                             prompt_lookup_min=5)),  # refused with -tp 2 later, by resolve_config
    "max_loras": ("3", 3), "max_lora_rank": ("8", 8), "max_cpu_loras": ("4", 4),
    "otlp_traces_endpoint": ("http://127.0.0.1:4317", "http://127.0.0.1:4317"),
    "distributed_executor_backend": ("ray", "ray"), "ray_address": ("10.0.0.1:6379", "10.0.0.1:6379"),
    "ray_placement_strategy": ("SPREAD", "SPREAD"),
}
# an adapter directory is checked at launch: test_the_lora_flags_reach_their_section takes these two
WITH_TP1_ONLY = {"enable_lora", "lora_modules"}
BOOLEANS = {"enable_prefix_caching", "async_scheduling", "batch_background", "enable_prompt_tokens_details"}
# off by default: the test turns them on
TRUE_BOOLEANS = {"enforce_eager", "enable_log_requests", "disable_log_stats", "enable_auto_tool_choice",
                 "enable_server_load_tracking", "enable_tokenizer_info_endpoint", "enable_request_id_headers",
                 "return_tokens_as_token_ids", "enable_force_include_usage", "disable_fastapi_docs"}


def test_every_field_is_a_flag_that_reaches_its_section():
    argv = ["serve", str(MODEL_DIR)]
    for section in SERVE_SECTIONS:
        for f in dataclasses.fields(section):
            flag = "--" + f.name.replace("_", "-")
            if f.name in WITH_TP1_ONLY:
                continue
            if f.name in BOOLEANS:
                argv.append("--no-" + flag[2:])
            elif f.name in TRUE_BOOLEANS:
                argv.append(flag)
            else:
                argv += [flag, NON_DEFAULTS[f.name][0]]
    config = ShuttleConfig.from_args(build_parser().parse_args(argv), IpcConfig.in_directory("/x",
                                                                                             tensor_parallel_size=2))
    for section, built in ((CacheConfig, config.cache), (SchedulerConfig, config.scheduler),
                           (WorkerConfig, config.worker), (type(config.ops), config.ops),
                           (type(config.parallel), config.parallel),
                           (type(config.observability), config.observability),
                           (type(config.tool_calls), config.tool_calls), (type(config.api), config.api),
                           (type(config.lora), config.lora)):
        for f in dataclasses.fields(section):
            if f.name in WITH_TP1_ONLY:
                continue
            want = False if f.name in BOOLEANS else True if f.name in TRUE_BOOLEANS else NON_DEFAULTS[f.name][1]
            assert getattr(built, f.name) == want, f.name


def test_the_lora_flags_reach_their_section(tmp_path):
    import json

    from shuttle.common.lora import LoRAModule

    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"\x02" + b"\x00" * 7 + b"{}")  # safetensors of no tensor
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    argv = ["serve", str(MODEL_DIR), "--enable-lora", "--lora-modules", f"sql={adapter}", "--max-loras", "2"]
    lora = ShuttleConfig.from_args(build_parser().parse_args(argv), IpcConfig.in_directory("/x")).lora
    assert (lora.enable_lora, lora.lora_modules, lora.max_loras) == (True, (LoRAModule(name="sql", path=str(adapter)),),
                                                                     2)


def test_defaults_come_from_the_declarations():
    args = build_parser().parse_args(["serve", str(MODEL_DIR)])
    config = ShuttleConfig.from_args(args, IpcConfig.in_directory("/x"))
    assert (config.cache, config.scheduler, config.worker) == (CacheConfig(), SchedulerConfig(), WorkerConfig())
    # every section, also those whose flags have a second spelling sharing the field (--disable-log-requests)
    for built in (config.ops, config.parallel, config.observability, config.tool_calls):
        assert built == type(built)(), type(built).__name__


@pytest.mark.parametrize("flag,value", [("--max-num-seqs", "0"), ("--kv-cache-memory", "lots"),
                                        ("--step-timeout", "-1"), ("--scheduling-policy", "random")])
def test_bad_values_are_usage_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", flag, value])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_an_unwritable_step_log_is_refused_before_any_process_starts(tmp_path):
    from shuttle.common.errors import ModelDirError
    from shuttle.launcher.scheduler_files import check_scheduler_files

    args = build_parser().parse_args(["serve", str(MODEL_DIR), "--step-log", str(tmp_path / "missing" / "steps.jsonl")])
    config = ShuttleConfig.from_args(args, IpcConfig.in_directory("/x"))  # config does no I/O of its own
    with pytest.raises(ModelDirError, match="--step-log .*missing/steps.jsonl: No such file or directory"):
        check_scheduler_files(config.scheduler)


@pytest.mark.parametrize("flags, words", [
    (["--tool-call-parser", "qwen"], "--tool-call-parser 'qwen' is not a tool-call parser; choose one of hermes, "
                                     "llama3_json, mistral"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
])
def test_tool_flags_are_refused_in_one_line(flags, words):
    from shuttle.common.errors import ModelDirError

    args = build_parser().parse_args(["serve", str(MODEL_DIR), *flags])
    with pytest.raises(ModelDirError) as exc:
        ShuttleConfig.from_args(args, IpcConfig.in_directory("/x"))
    assert str(exc.value).startswith(words) and "\n" not in str(exc.value)


def test_a_tool_call_parser_alone_is_taken():
    args = build_parser().parse_args(["serve", str(MODEL_DIR), "--tool-call-parser", "hermes"])
    config = ShuttleConfig.from_args(args, IpcConfig.in_directory("/x"))
    assert (config.tool_calls.enable_auto_tool_choice, config.tool_calls.tool_call_parser) == (False, "hermes")
    assert ShuttleConfig.from_json(config.to_json()).tool_calls == config.tool_calls


def test_the_api_key_comes_from_vllms_variable_too(monkeypatch, tmp_path):
    """A deployment moved from vLLM keeps its key in VLLM_API_KEY: it must not run unauthenticated."""
    import argparse

    from shuttle.launcher.commands import _api_key

    args = argparse.Namespace(api_key=None, api_key_file=None)
    monkeypatch.delenv("SHUTTLE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _api_key(args) == "from-vllm"
    monkeypatch.setenv("SHUTTLE_API_KEY", "from-shuttle")
    assert _api_key(args) == "from-shuttle"
    assert _api_key(argparse.Namespace(api_key="given", api_key_file=None)) == "given"


@pytest.mark.parametrize("content", ["", "\n\nsecond\n", "   \n"])
def test_a_key_file_without_a_key_is_refused_not_served_open(content, tmp_path, no_launch, capsys):
    """A trial: an empty mounted secret started a server that answered every route with no key."""
    key_file = tmp_path / "key"
    key_file.write_text(content)
    assert cli.main(["serve", str(MODEL_DIR), "--port", "0", "--api-key-file", str(key_file)]) == 2
    assert capsys.readouterr().err == (f"shuttle: error: --api-key-file {key_file}: its first line holds no key (an "
                                       f"empty file would serve with no key at all)\n")


def test_a_key_given_twice_is_refused(tmp_path, no_launch, capsys):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    argv = ["serve", str(MODEL_DIR), "--port", "0", "--api-key-file", str(key_file), "--api-key", "flag"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == "shuttle: error: --api-key and --api-key-file are both given: give one\n"


@pytest.mark.parametrize("flags, says", [
    (["--served-model-name", "a", "b", "a"], "--served-model-name a is given twice"),
    (["--root-path", "/llm?x=1"], "'/llm?x=1' is not a path prefix: it holds '?'"),
    (["--allowed-origins", ""], "names no origin: ''"),
    (["--allowed-origins", "[]"], "names no origin: '[]'"),
])
def test_flags_that_could_never_take_effect_are_refused(flags, says, no_launch, capsys):
    """A trial: each was taken without a word (a name listed twice on /v1/models, a prefix no path matches, an empty
    origin list that allowed nothing)."""
    try:
        code = cli.main(["serve", str(MODEL_DIR), "--port", "0", *flags])
    except SystemExit as exc:  # the parser's refusals exit; the launcher's checks return
        code = exc.code
    assert code == 2 and says in capsys.readouterr().err
