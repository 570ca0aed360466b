"""`--config FILE.yaml` for `shuttle serve` and `shuttle engine`, as vLLM takes it: the file's keys are long flag
names and its values are as on the command line; the file's flags go before the command line's, so that the command
line wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CONFIG_MODEL_FLAG = "--config-file-model"  # where a file's `model` key goes: the command line's MODEL wins over it


class ConfigFileError(ValueError):
    """--config FILE cannot be read or names what no flag is; the message is one line."""


def expand_config_file(argv: list[str], command_parser: argparse.ArgumentParser) -> list[str]:
    """`argv` (from the command on) with the flags of its --config FILE.yaml put before its own, so that a flag on
    the command line wins over the file's. MODEL, when typed right after the command, stays first.

    A key is a long flag name, with - or _; a value is as on the command line: true / false for a switch (false
    gives --no-X where there is one), a list for a flag that takes several values (or repeats), anything else
    one value (a list or mapping as JSON, as vLLM takes --allowed-origins or --speculative-config).

    Raises:
        ConfigFileError: unreadable, not YAML, not a mapping, or a key that is no flag of the command.
    """
    path = _config_path(argv)
    if path is None:
        return argv
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path}: not YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return argv
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: must be a mapping of flag names to values")
    tokens = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        action = command_parser._option_string_actions.get(flag)
        if flag in ("--config", "--help"):
            raise ConfigFileError(f"--config {path}: key {key!r} is not taken in a config file ({flag} only on the "
                                  f"command line)")
        if action is None:
            raise ConfigFileError(f"--config {path}: unknown key {key!r} (`{command_parser.prog}` has no {flag})")
        if flag == "--model":
            flag, action = CONFIG_MODEL_FLAG, command_parser._option_string_actions[CONFIG_MODEL_FLAG]
        tokens += _flag_tokens(flag, action, value, path)
    model = argv[1:2] if len(argv) > 1 and not argv[1].startswith("-") else []
    return argv[:1] + model + tokens + argv[1 + len(model):]


def _config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--":
            return None
        if token == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def _flag_tokens(flag: str, action: argparse.Action, value: Any, path: str) -> list[str]:
    if value is None:
        return []
    if action.nargs == 0:  # a switch: store_true, store_false, or BooleanOptionalAction (--x / --no-x)
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {flag[2:]} is a switch: give true or false, not {value!r}")
        if value:
            return [flag]
        negative = "--no-" + flag[2:]
        return [negative] if negative in action.option_strings else []
    if isinstance(action, argparse._AppendAction) and isinstance(value, list):
        return [token for item in value for token in (flag, _text(item))]
    if action.nargs in ("+", "*") and isinstance(value, list):
        return [flag, *map(_text, value)]
    return [flag, _text(value)]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)
