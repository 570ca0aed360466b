"""--speculative-config: vLLM's JSON form, parsed into a typed struct. Only the n-gram (prompt lookup) method is
implemented; any other method or key is refused by name at parse time."""

from __future__ import annotations

import argparse

import msgspec


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """N-gram speculation: each decoding sequence proposes the tokens that followed the longest earlier
    occurrence of its last tokens (scheduler/ngram.py), and the worker verifies them in one forward.

    Attributes:
        method: "ngram" (vLLM's name for prompt lookup).
        num_speculative_tokens: most drafts per sequence and step (k).
        prompt_lookup_max, prompt_lookup_min: longest and shortest suffix looked up, in tokens.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's value, with vLLM's defaults for a missing lookup bound (both missing: 5 and 5; one
    missing: the other's value).

    Raises:
        argparse.ArgumentTypeError: not JSON, an unknown key, a method other than ngram, or a bad number.
    """
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    method = raw.get("method")
    if method != "ngram":
        raise argparse.ArgumentTypeError(f"method {method!r} is not implemented (only \"ngram\", prompt lookup)")
    unknown = sorted(set(raw) - set(SpeculativeConfig.__struct_fields__))
    if unknown:
        raise argparse.ArgumentTypeError(f"key {unknown[0]!r} is not implemented (ngram takes num_speculative_tokens, "
                                         f"prompt_lookup_max, prompt_lookup_min)")
    try:
        config = msgspec.convert(raw, SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    if low is None and high is None:
        low = high = 5
    low = high if low is None else low
    high = low if high is None else high
    assert low is not None and high is not None  # each filled from the other
    if config.num_speculative_tokens < 1:
        raise argparse.ArgumentTypeError("num_speculative_tokens must be at least 1")
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}")
    return msgspec.structs.replace(config, prompt_lookup_min=low, prompt_lookup_max=high)
