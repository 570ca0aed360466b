"""`LLM(model, **engine_args)`'s keywords made a ShuttleConfig: each is a `shuttle serve` option by its field name
(max_model_len, max_num_seqs, dtype, seed, ...), parsed by serve's own parser, so a value means here what its flag
means there and is refused with the same words.

What only a server has (its address, API key, HTTP limits, other processes) is refused by name: the offline engine
runs in the caller's process and answers no one else, so such a setting could only be ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
from typing import Any

from shuttle.common.config import ApiConfig, IpcConfig, ObservabilityConfig, OpsConfig, ShuttleConfig, ToolCallConfig
from shuttle.common.devices import cuda_device_count, resolve_config

# serve's options that configure what the offline engine does not have, by field name, with what that is
_SERVER_ONLY: dict[str, str] = {
    **{name: "the HTTP server" for name in ("host", "port", "api_key", "api_key_file", "allowed_origins",
                                            "served_model_name", "batch_endpoint")},
    **{f.name: "the HTTP server" for f in dataclasses.fields(ApiConfig)},
    **{f.name: "the server's tool-call parsing" for f in dataclasses.fields(ToolCallConfig)},
    **{f.name: "the launcher's supervision of processes" for f in dataclasses.fields(OpsConfig)},
    **{f.name: "the server's logs" for f in dataclasses.fields(ObservabilityConfig)},
    "disable_log_requests": "the server's logs",
    "log_level": "the server's processes",
    "config": "the command line (pass the options as keywords)",
    "model_option": "the command line (pass the model as LLM's first argument)",
    "zmq_transport": "the server's processes", "engine_endpoint": "the server's processes",
    "master_addr": "tensor parallel (several processes)", "master_port": "tensor parallel (several processes)",
    "worker_cores": "the server's processes (pinning them to cores)",
    "ttft_slo_ms": "a server's admission of requests", "step_cost_profile": "a server's admission of requests",
    "step_log": "the server's scheduler process", "batch_background": "the server's batch endpoint",
}
# options taken only with the value that names what the offline engine does
_ONLY_VALUE: dict[str, tuple[Any, str]] = {
    "tensor_parallel_size": (1, "the offline engine runs in this process, and tensor parallel needs one process per "
                                "rank: use `shuttle serve --tensor-parallel-size N`"),
    "data_parallel_size": (1, "the offline engine is one serving group: use `shuttle serve -dp N`"),
    "disable_log_stats": (True, "the offline engine logs no periodic stats line"),
}


def _serve_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.Action]]:
    """The top-level parser and serve's options by keyword: a flag's long name with _ for - and . (the field
    name, --max-model-len -> max_model_len), else its dest."""
    from shuttle.launcher.cli import _command_parser, build_parser

    parser = build_parser()
    actions: dict[str, argparse.Action] = {}
    for action in _command_parser(parser, "serve")._actions:
        if not action.option_strings or action.dest == "help":
            continue
        names = [s.lstrip("-").replace("-", "_").replace(".", "_") for s in action.option_strings
                 if s.startswith("--") and not s.startswith("--no-")]
        for name in [*names, action.dest]:
            actions.setdefault(name, action)
    return parser, actions


def _flag_words(name: str, value: Any, action: argparse.Action) -> list[str]:
    """The command-line words that give option `name` the Python value `value`.

    Raises:
        ValueError: a switch given something other than True or False.
    """
    flag = next(s for s in action.option_strings if s.startswith("--"))
    if type(value).__module__ == "torch":  # vLLM takes dtype=torch.float16 as well as "float16"
        value = str(value).removeprefix("torch.")
    if action.nargs == 0:  # a switch: store_true / store_false / --x and --no-x
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, not {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        if value == action.const:
            return [flag]
        if value == action.default:
            return []
        raise ValueError(f"{name}={value!r} is not an option of shuttle serve (its flag {flag} sets {action.const!r})")
    if action.nargs in ("+", "*") and isinstance(value, (list, tuple)):
        return [flag, *(str(v) for v in value)]
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return [f"{flag}={text}"]


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argv through serve's parser; its refusals (all of them, in one message) as a ValueError."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(argv)
    except SystemExit:
        message = errors.getvalue().strip()
        raise ValueError(message.split(": error: ", 1)[-1] or "the options were refused") from None


def engine_config(model: str, engine_args: dict[str, Any]) -> ShuttleConfig:
    """The ShuttleConfig of `LLM(model, **engine_args)`, with its device, dtype and attention backend resolved as
    `shuttle serve` resolves them.

    Args:
        model: a model directory or a Hugging Face id (as `shuttle serve MODEL`).
        engine_args: serve's options by field name, as Python values (True/False for a switch, a list for several
            values, a dict for a JSON one); None keeps the option's default, as in vLLM.
    Raises:
        TypeError: a keyword that is no option of `shuttle serve`.
        ValueError: an option the offline engine cannot honour, or a value serve's parser refuses.
        ModelDirError: the model cannot be found or read.
        DeviceError: the device, dtype or quantization cannot be served here.
    """
    from shuttle.launcher.model_args import resolve_model_args

    parser, actions = _serve_parser()
    argv = ["serve", str(model)]
    for name, value in engine_args.items():
        action = actions.get(name)
        if action is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r} (not an option of shuttle serve)")
        if value is None:
            continue
        if name in _ONLY_VALUE:
            if value != _ONLY_VALUE[name][0]:
                raise ValueError(f"{name}={value!r}: {_ONLY_VALUE[name][1]} (taken: {_ONLY_VALUE[name][0]!r})")
        elif name in _SERVER_ONLY:
            raise ValueError(f"{name}: an option of shuttle serve for {_SERVER_ONLY[name]}, which the offline LLM "
                             f"does not have")
        argv += _flag_words(name, value, action)
    args = _parse(parser, argv)
    resolve_model_args(args)
    # no sockets: the scheduler and the model run in this process (scheduler/in_process.py)
    config = ShuttleConfig.from_args(args, IpcConfig(requests="", plans="", results="", control=""))
    return resolve_config(config, 1, cuda_device_count())
