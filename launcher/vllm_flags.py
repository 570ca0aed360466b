"""What `shuttle serve` makes of `vllm serve`'s flags that are not shuttle's own: those it takes because the values
they are given name what shuttle does anyway (TAKEN_FLAGS: listed in --help, any other value refused by name), and
those it refuses whatever their value (REFUSED_FLAGS: left out of --help). Nothing is taken and ignored.

Every refusal of one command line is reported at once: RefusingParser collects them while it parses and exits 2 with
one message naming each refused flag and why, with the flags no parser knows (argparse's "unrecognized arguments")
and a bad value of another flag in the same message.

docs/vllm-flags.md tells each `vllm serve` flag's status; tests/unit/test_vllm_flags.py holds the two to each other.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, NamedTuple

NOT_IMPLEMENTED = "shuttle does not implement it"

# vLLM's flags that shuttle refuses whatever their value, by option string, with the reason
# (add_vllm_flags leaves out any that shuttle has come to implement)
REFUSED_FLAGS: dict[str, str] = {
    "--ssl-keyfile": "TLS is not implemented: terminate it in a reverse proxy",
    "--ssl-certfile": "TLS is not implemented: terminate it in a reverse proxy",
    "--allow-credentials": "credentialed CORS (cookies) is not implemented: a browser page sends the API key in an "
                           "Authorization header, which --allowed-origins allows",
}


class TakenFlag(NamedTuple):
    """A vLLM flag shuttle takes with the values that name what it does anyway.

    Attributes:
        help: --help's text: what shuttle does, which values are taken and why.
        refusal: a value as typed -> None when it is taken, else why shuttle refuses it (one clause); raises
            argparse.ArgumentTypeError for a value that is malformed (not a number, not JSON).
        metavar: --help's name for the value.
        aliases: vLLM's other spellings of the flag (-pp).
    """

    help: str
    refusal: Callable[[str], str | None]
    metavar: str
    aliases: tuple[str, ...] = ()


def _one_of(*taken: str, why: str) -> Callable[[str], str | None]:
    """A refusal of every value but `taken`: `why` says what shuttle does instead."""
    def refusal(value: str) -> str | None:
        return None if value in taken else f"{why} (taken: {', '.join(taken)})"
    return refusal


def _everything(what: str) -> Callable[[str], str | None]:
    """A refusal of every value but vLLM's default `["*"]` (or `*`): shuttle's CORS allows every `what`."""
    def refusal(value: str) -> str | None:
        try:
            everything = value.strip() == "*" or json.loads(value) == ["*"]
        except ValueError:
            everything = False
        return None if everything else f"a preflight allows every {what} (taken: [\"*\"])"
    return refusal


def _number(text: str, at_least: float, integer: bool) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        value = None
    if value is None or not value >= at_least:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if integer else 'a number'} >= {at_least:g}")
    return value


def _equal_to(taken: int, why: str) -> Callable[[str], str | None]:
    """A refusal of every integer but `taken` (a non-integer is malformed)."""
    def refusal(value: str) -> str | None:
        return None if _number(value, 0, integer=True) == taken else f"{why} (taken: {taken})"
    return refusal


def _any_number(at_least: float, integer: bool = False) -> Callable[[str], str | None]:
    """Every number >= at_least is taken."""
    def refusal(value: str) -> str | None:
        _number(value, at_least, integer)
        return None
    return refusal


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _text_only(value: str) -> str | None:
    """--limit-mm-per-prompt: a JSON object of modality -> most items per prompt (a count, or vLLM's
    {"count": N, ...}); taken when every count is 0."""
    for modality, limit in _json_object(value).items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(f"{modality!r}: {json.dumps(limit)} is not a count")
        if count:
            return f"shuttle serves text only: a prompt can hold no {modality} (taken: counts of 0)"
    return None


_GRAMMAR_BACKEND = _one_of("auto", "xgrammar", why="structured outputs and tool-call grammars are compiled by xgrammar")


def _structured_outputs(value: str) -> str | None:
    """--structured-outputs-config as a JSON object: only its backend is taken."""
    config = _json_object(value)
    others = sorted(set(config) - {"backend"})
    if others:
        return f"only the backend is taken, not {', '.join(others)}"
    return _GRAMMAR_BACKEND(str(config.get("backend", "auto")))


TAKEN_FLAGS: dict[str, TakenFlag] = {
    "--load-format": TakenFlag(
        "auto and safetensors, what shuttle does: transformers loads the model's safetensors (with auto, else its "
        "pytorch_model.bin, as vLLM's auto); other formats are refused",
        _one_of("auto", "safetensors", why="transformers loads the checkpoint's safetensors or pytorch_model.bin"),
        "{auto,safetensors}"),
    "--tokenizer-mode": TakenFlag(
        "auto and hf, what shuttle does: prompts are tokenized with the model's tokenizer.json (Hugging Face's fast "
        "tokenizer); other modes are refused",
        _one_of("auto", "hf", why="prompts are tokenized with the model's tokenizer.json"), "{auto,hf}"),
    "--config-format": TakenFlag(
        "auto and hf, what shuttle does: config.json is read as Hugging Face writes it; other formats are refused",
        _one_of("auto", "hf", why="the model's config.json is read as Hugging Face writes it"), "{auto,hf}"),
    "--structured-outputs-config.backend": TakenFlag(
        "auto and xgrammar, what shuttle does: xgrammar compiles every structured output and tool-call grammar; "
        "other backends are refused", _GRAMMAR_BACKEND, "{auto,xgrammar}"),
    "--structured-outputs-config": TakenFlag(
        "vLLM's JSON form of the above: {\"backend\": \"xgrammar\"} (or auto) is taken; any other key is refused",
        _structured_outputs, "JSON"),
    "--limit-mm-per-prompt": TakenFlag(
        "a JSON object whose counts are all 0, e.g. '{\"image\":0}', what shuttle does: it serves text only; a "
        "non-zero count is refused", _text_only, "JSON"),
    "--pipeline-parallel-size": TakenFlag(
        "1, what shuttle does: one pipeline stage (spread a model over devices with --tensor-parallel-size, "
        "replicate it with -dp); more stages are refused",
        _equal_to(1, "one pipeline stage: spread a model with --tensor-parallel-size, replicate it with -dp"), "1",
        ("-pp",)),
    "--show-hidden-metrics-for-version": TakenFlag(
        "any version, what shuttle does: it hides no metric, so /metrics serves every series whatever version is "
        "named", lambda value: None, "VERSION"),
    "--swap-space": TakenFlag(
        "any size in GiB (vLLM's default 4): vLLM's V1 engine never swaps a preempted request's KV to CPU memory "
        "but recomputes it, as shuttle does, and deprecated the flag (0.18) as unused",
        _any_number(0), "GiB"),
    "--cpu-offload-gb": TakenFlag(
        "0, what shuttle does: weights stay on the device that runs them; any other size is refused",
        lambda value: None if _number(value, 0, integer=False) == 0 else
        "weights stay on the device that runs them (taken: 0)", "GiB"),
    "--response-role": TakenFlag(
        "assistant, what shuttle does: chat responses have the role assistant; any other role is refused",
        _one_of("assistant", why="chat responses always have the role assistant"), "assistant"),
    "--allowed-methods": TakenFlag(
        '["*"] (vLLM\'s default), what shuttle does: a CORS preflight allows every method its routes take (GET, POST, '
        "DELETE, OPTIONS); a narrower list is refused", _everything("method of shuttle's routes"), "JSON"),
    "--allowed-headers": TakenFlag(
        '["*"] (vLLM\'s default), what shuttle does: a CORS preflight allows every request header the browser asks '
        "for; a narrower list is refused", _everything("request header"), "JSON"),
    "--max-num-partial-prefills": TakenFlag(
        "1 (vLLM's default, the only value its V1 engine takes), what shuttle does: prompts are prefilled in chunks "
        "as vLLM V1 does, a long one's share of a step bounded by --long-prefill-token-threshold; more are refused",
        _equal_to(1, "vLLM V0's concurrent partial prefills are not implemented; --long-prefill-token-threshold "
                     "bounds a long prompt's share of a step"), "1"),
}


class RefusingParser(argparse.ArgumentParser):
    """An ArgumentParser that reports every refused vLLM flag of one command line in one message (exit 2), together
    with the flags it does not know and any other usage error it meets; without refusals it behaves as
    argparse.ArgumentParser (an unknown flag alone is argparse's own "unrecognized arguments"). An error prints a
    one-line usage (`usage: shuttle serve [options] MODEL`) before it, not the whole flag list (--help has that)."""

    refusals: list[str]

    def parse_known_args(self, args=None, namespace=None):
        self.refusals = []
        parsed, extras = super().parse_known_args(args, namespace)
        if self.refusals:
            self.error(f"unrecognized arguments: {' '.join(extras)}" if extras else "")
        return parsed, extras

    def error(self, message: str):
        problems = [*getattr(self, "refusals", []), *([message] if message else [])]
        self.refusals = []
        if len(problems) > 1:
            message = f"{len(problems)} problems, all of them refused before anything started:\n  " + \
                      "\n  ".join(problems)
        else:
            message = problems[0]
        # argparse would print the whole usage first (80 lines of flags above the one line that matters)
        positionals = " ".join(a.metavar if isinstance(a.metavar, str) else a.dest
                               for a in self._actions if not a.option_strings)
        self.exit(2, f"usage: {self.prog} [options]{' ' + positionals if positionals else ''}\n"
                     f"{self.prog}: error: {message}\n")


def _refuse(parser: argparse.ArgumentParser, problem: str) -> None:
    """Report `problem` with the others of its command line (RefusingParser), else at once."""
    if isinstance(parser, RefusingParser):
        parser.refusals.append(problem)
    else:
        parser.error(problem)


class _Refused(argparse.Action):
    """A flag of REFUSED_FLAGS: refused, whatever its value."""

    def __call__(self, parser, namespace, values, option_string=None):
        flag = self.option_strings[0]
        _refuse(parser, f"{flag}: {NOT_IMPLEMENTED}: {REFUSED_FLAGS[flag]}")


class AlwaysOn(argparse.BooleanOptionalAction):
    """A vLLM switch for what shuttle always does: `--X` is taken, `--no-X` refused by name with the other refusals
    of its command line (RefusingParser). `why`: the refusal's reason."""

    def __init__(self, option_strings, dest, why: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None and option_string.startswith("--no-"):
            _refuse(parser, f"{option_string}: {NOT_IMPLEMENTED}: {self.why}")
        else:
            setattr(namespace, self.dest, True)


class _Taken(argparse.Action):
    """A flag of TAKEN_FLAGS: its value kept as typed when taken, else refused by name."""

    def __call__(self, parser, namespace, values, option_string=None):
        flag = self.option_strings[-1]  # the long name (an alias comes first)
        try:
            why = TAKEN_FLAGS[flag].refusal(values)
        except argparse.ArgumentTypeError as exc:
            _refuse(parser, f"{flag}: {exc}")
            return
        if why is None:
            setattr(namespace, self.dest, values)
        else:
            _refuse(parser, f"{flag} {values}: {NOT_IMPLEMENTED}: {why}")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add TAKEN_FLAGS to `parser` (in a group of --help of their own) and REFUSED_FLAGS (left out of --help), but
    for those `parser` already has. A taken flag's value, as typed, is at its dest (`--load-format` ->
    args.load_format; absent when not given)."""
    group = parser.add_argument_group("vLLM flags taken because they name what shuttle does anyway")
    for flag, taken in TAKEN_FLAGS.items():
        if flag not in parser._option_string_actions:
            group.add_argument(*taken.aliases, flag, action=_Taken, metavar=taken.metavar, help=taken.help,
                               dest=flag.lstrip("-").replace("-", "_").replace(".", "_"), default=argparse.SUPPRESS)
    for flag in REFUSED_FLAGS:
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, nargs="?", action=_Refused, dest="refused_flag", default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
