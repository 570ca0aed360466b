"""Command-line value parsers shared by the config declarations and every command's flags, and the flags derived
from a config section's field declarations (add_config_options).

Each parser raises argparse.ArgumentTypeError with a message naming what was expected, which argparse turns into a
one-line usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from dataclasses import field
from pathlib import Path

from shuttle.common.sampling import seed_fits

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1048576' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


_TOKEN_COUNT = re.compile(r"^(\d+(?:\.\d+)?)([kmgtKMGT]?)$")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def token_count(text: str) -> int:
    """An integer >= 1, with vLLM's suffixes for lengths: lower case is decimal, upper case binary, so '32k' is
    32,000, '32K' 32,768 and '25.6k' 25,600 (a fraction only with a decimal suffix)."""
    match = _TOKEN_COUNT.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (an integer, or with a suffix: 32k = 32000, "
                                         f"32K = 32768)")
    number, suffix = match.groups()
    if "." in number and suffix not in _DECIMAL:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction needs a decimal (lower-case) suffix, e.g. "
                                         f"{number}{suffix.lower() or 'k'}")
    value = int(float(number) * _DECIMAL[suffix]) if suffix in _DECIMAL else int(number) * _BINARY.get(suffix, 1)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


# vLLM's --dtype spellings that name one of shuttle's dtypes
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def dtype_name(text: str) -> str:
    """A dtype name, vLLM's aliases (half, float) made canonical (float16, float32); argparse's `choices` then
    refuses anything else."""
    return DTYPE_ALIASES.get(text, text)


def positive(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def seed(text: str) -> int:
    """An integer that fits in 64 bits, signed or not (common/sampling.py seed_fits, as a request's `seed`)."""
    value = int(text)
    if not seed_fits(value):
        raise argparse.ArgumentTypeError(f"must fit in 64 bits, got {value}")
    return value


def logprobs_cap(text: str) -> int:
    """An integer >= 0, or -1 for no cap (vLLM's --max-logprobs: then the vocabulary bounds a request alone)."""
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (no cap) or at least 0, got {value}")
    return value


def zmq_endpoint(text: str) -> str:
    """A ZeroMQ endpoint shuttle's sockets take: tcp://HOST:PORT (PORT 0-65535, or * for any free one) or
    ipc://PATH (libzmq would refuse anything else only once a process binds or connects it)."""
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    if text.startswith("tcp://"):
        host, sep, port = text[len("tcp://"):].rpartition(":")
        if sep and host and (port == "*" or port.isdigit() and int(port) <= 65535):
            return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a ZeroMQ endpoint: tcp://HOST:PORT or ipc://PATH")


def zmq_endpoint_or_none(text: str) -> str:
    """zmq_endpoint, or "none" (off)."""
    return text if text == "none" else zmq_endpoint(text)


def output_file(text: str) -> str:
    """A file path a tool writes its results to at the end of its run: refused at once when it is a directory or its
    folder cannot be made (the run's results would be lost to a traceback); the folder is made here."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: its folder cannot be made ({exc.strerror or exc})") from None
    return text


def served_name(text: str) -> str:
    """A name clients give as `model`: not empty, no whitespace at either end ("" was ignored, and the server served
    under the model's own name)."""
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: a served model name must not be empty or start or end with "
                                         "whitespace")
    return text


def count(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _number_above_zero(text: str, what: str, infinite: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= (math.inf if infinite else sys.float_info.max):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0."""
    return _number_above_zero(text, "a number > 0", infinite=False)


def request_rate(text: str) -> float:
    """Requests per second > 0, or 'inf' (every request at once)."""
    return _number_above_zero(text, "a rate > 0 (requests per second) or inf", infinite=True)


def seconds(text: str) -> float:
    """A number of seconds >= 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def unit_fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def range_ratio(text: str) -> float:
    """A load tool's length spread r in [0, 1): lengths drawn in len x (1 +- r), as vLLM's bench takes it."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


def origins(text: str) -> tuple[str, ...]:
    """'https://a.example,https://b.example', or vLLM's JSON list '["https://a.example", "https://b.example"]' -> a
    tuple of origins; '*' allows any."""
    if text.lstrip().startswith("["):
        try:
            listed = json.loads(text)
        except ValueError:
            listed = None
        if not isinstance(listed, list) or not all(isinstance(o, str) for o in listed):
            raise argparse.ArgumentTypeError(f"not a JSON list of origins: {text!r}")
    else:
        listed = text.split(",")
    found = tuple(o.strip().rstrip("/") for o in listed if o.strip())
    if not found:  # an empty flag allowed nothing while it read as if origins had been set
        raise argparse.ArgumentTypeError(f"names no origin: {text!r} (scheme://host[:port], or *)")
    for origin in found:
        if origin != "*" and not re.match(r"^https?://[^/\s]+$", origin):
            raise argparse.ArgumentTypeError(f"not an origin: {origin!r} (scheme://host[:port], or *)")
    return found


def path_prefix(text: str) -> str:
    """A URL path prefix (--root-path /llm): no query, fragment or whitespace, which no request path can match."""
    bad = next((c for c in text if c in "?#" or c.isspace()), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a path prefix: it holds {bad!r}, which no request path can "
                                         f"match")
    return text


def json_object(text: str) -> dict:
    """A JSON object, as vLLM takes a flag whose value is a dict (--hf-overrides '{"key": 1}')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


JINJA_MARKS = ("{{", "{%")  # what makes a --chat-template value that names no file the template itself


def chat_template_text(value: str) -> str:
    """The template `--chat-template value` gives: the file `value` names, else `value` itself when it holds Jinja
    syntax ({{ or {%), as vLLM takes it.

    Raises:
        argparse.ArgumentTypeError: an unreadable file, neither a file nor a template, or a template that does not
            compile (a Jinja syntax error: refused at start-up, not answered as every chat request's 400).
    """
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # a template longer than a file name, or holding a NUL
        is_file = False
    if is_file:
        try:
            text = Path(value).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {value}: {getattr(exc, 'strerror', None) or exc}") from None
        _check_template_syntax(text, value)
        return text
    if any(mark in value for mark in JINJA_MARKS):
        _check_template_syntax(value, "the template given")
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a Jinja template (which holds {{{{ or {{%)")


def _check_template_syntax(text: str, where: str) -> None:
    """Compile `text` as transformers will render it (its Jinja environment and extensions; cached there)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(f"{where} is no valid Jinja template: {exc.message} (line {exc.lineno})"
                                         ) from None


def chat_template(value: str) -> str:
    """--chat-template's parser: `value` as given, once chat_template_text has read it."""
    chat_template_text(value)
    return value


def option(default, help: str, **argparse_kwargs):
    """A config field declared once: its default, its help text and how `shuttle serve` parses it.

    add_config_options (below) derives the flag `--field-name` from it (booleans get
    `--no-field-name` too), and ShuttleConfig.from_args reads it back by name, so a new field needs no other edit to
    be settable.
    `argparse_kwargs`: type, choices, metavar, as argparse takes them.
    """
    return field(default=default, metadata={"help": help, **argparse_kwargs})


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # the processes' log levels (--log-level)


def add_config_options(parser, section, names: list[str] | None = None, **overrides) -> None:
    """Add `--field-name` flags for the fields of config dataclass `section` (all, or those in `names`).

    A field's default, help and parsing come from its declaration (`option` above); a bool becomes
    --x / --no-x. `overrides` maps a field name to argparse keywords that differ here (e.g. {"default": None} where a
    command computes it).
    """
    for f in dataclasses.fields(section):
        if names is not None and f.name not in names:
            continue
        meta = dict(f.metadata)
        aliases = meta.pop("aliases", ())  # vLLM's short spellings (-tp)
        kwargs = {"default": f.default, "help": meta.pop("help")}
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        kwargs.update(meta)
        if kwargs.get("action") == "extend":  # argparse extends a list default, never a tuple: the section's
            kwargs["default"] = None          # __post_init__ turns None into its empty tuple
        kwargs.update(overrides.get(f.name, {}))
        parser.add_argument(*aliases, "--" + f.name.replace("_", "-"), **kwargs)
