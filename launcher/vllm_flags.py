"""What `shuttle serve` makes of a `vllm serve` command line beyond its own flags: vLLM's flags that shuttle does not
implement, refused by name with the reason (never "unrecognized arguments", never taken and ignored), and
`--config FILE.yaml`, whose keys are long flag names and whose values are as on the command line.

docs/vllm-flags.md tells each of `vllm serve`'s most-used flags' status; tests/unit/test_vllm_flags.py holds the two to
each other.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NamedTuple


class RefusedFlag(NamedTuple):
    """A vLLM flag shuttle does not implement: why, and the one value taken all the same because it asks for what
    shuttle does anyway (None: every use is refused)."""

    why: str
    accepted: str | None = None


# vLLM's flags, by option string (add_refused_flags leaves out any that shuttle has come to implement)
REFUSED_FLAGS: dict[str, RefusedFlag] = {
    "--swap-space": RefusedFlag("a preempted request's KV is recomputed, never swapped to CPU memory", "0"),
    "--cpu-offload-gb": RefusedFlag("weights stay on the device that runs them", "0"),
    "--speculative-config": RefusedFlag("speculative decoding is not implemented"),
    "--enable-lora": RefusedFlag("LoRA adapters are not implemented"),
    "--lora-modules": RefusedFlag("LoRA adapters are not implemented"),
    "--ssl-keyfile": RefusedFlag("TLS is not implemented: terminate it in a reverse proxy"),
    "--ssl-certfile": RefusedFlag("TLS is not implemented: terminate it in a reverse proxy"),
    "--response-role": RefusedFlag("chat responses always have the role assistant", "assistant"),
    "--max-num-partial-prefills": RefusedFlag("how many prompts are prefilled in chunks at once is bounded by "
                                              "--max-num-batched-tokens and --long-prefill-token-threshold"),
}


class _Refuse(argparse.Action):
    """A refused flag: a usage error (exit 2) naming it, unless its value is the one accepted."""

    def __call__(self, parser, namespace, values, option_string=None):
        refused = REFUSED_FLAGS[self.option_strings[0]]
        if refused.accepted is not None and values == refused.accepted:
            return
        also = f" (only {refused.accepted} is taken)" if refused.accepted is not None else ""
        parser.error(f"{self.option_strings[0]}: shuttle does not implement it: {refused.why}{also}")


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """Add REFUSED_FLAGS to `parser`, left out of --help, but for those `parser` already has."""
    for flag in REFUSED_FLAGS:
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, nargs="?", action=_Refuse, dest="refused_flag", default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)


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
        if action is None or flag in ("--config", "--help"):
            raise ConfigFileError(f"--config {path}: unknown key {key!r} (`{command_parser.prog}` has no {flag})")
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
