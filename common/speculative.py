"""--speculative-config: vLLM's JSON form, parsed into a typed struct. Two methods are implemented: "ngram" (prompt
lookup, scheduler/ngram.py) and "draft_model" (a smaller model with the target's vocabulary, run by the same worker:
worker/draft_model.py). Any other method or key is refused by name at parse time."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from shuttle.common.errors import ModelDirError
from shuttle.common.model_dir import check_model_dir

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
_KEYS = {NGRAM: ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
         DRAFT_MODEL: ("model", "num_speculative_tokens", "draft_tensor_parallel_size")}


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding: each decoding sequence gets up to k drafts per step, and the worker verifies them in
    the step's one forward of the target model.

    Attributes:
        method: "ngram" (vLLM's name for prompt lookup) or "draft_model".
        num_speculative_tokens: most drafts per sequence and step (k).
        prompt_lookup_max, prompt_lookup_min: ngram: longest and shortest suffix looked up, in tokens.
        model: draft_model: the draft model's directory (its vocabulary must be the target's).
        draft_tensor_parallel_size: draft_model: 1 (the draft runs unsharded beside the target).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int = 1


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's value. ngram takes vLLM's defaults for a missing lookup bound (both missing: 5 and
    5; one missing: the other's value). A config with a model and no method is a draft model, as vLLM reads it.

    Raises:
        argparse.ArgumentTypeError: not JSON, an unknown method or key, a missing model, or a bad number.
    """
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    if raw.get("method") is None and raw.get("model") is not None:
        raw["method"] = DRAFT_MODEL
    method = raw.get("method")
    if method not in _KEYS:
        raise argparse.ArgumentTypeError(f"method {method!r} is not implemented (\"ngram\", prompt lookup, or "
                                         f"\"draft_model\")")
    unknown = sorted(set(raw) - {"method", *_KEYS[method]})
    if unknown:
        raise argparse.ArgumentTypeError(f"key {unknown[0]!r} is not implemented ({method} takes "
                                         f"{', '.join(_KEYS[method])})")
    try:
        config = msgspec.convert(raw, SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if config.num_speculative_tokens < 1:
        raise argparse.ArgumentTypeError("num_speculative_tokens must be at least 1")
    if method == DRAFT_MODEL:
        if not config.model:
            raise argparse.ArgumentTypeError("draft_model needs \"model\": the draft model's directory")
        if config.draft_tensor_parallel_size != 1:
            raise argparse.ArgumentTypeError("draft_tensor_parallel_size other than 1 is not implemented")
        return config
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    if low is None and high is None:
        low = high = 5
    low = high if low is None else low
    high = low if high is None else high
    assert low is not None and high is not None  # each filled from the other
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}")
    return msgspec.structs.replace(config, prompt_lookup_min=low, prompt_lookup_max=high)


def checked_draft_model(config: SpeculativeConfig, target_hf_config: dict) -> SpeculativeConfig:
    """The config with a draft model's directory made absolute, once that directory has been checked as the
    target's is (common/model_dir.py) and its vocabulary found equal to the target's. Other methods pass unchanged.

    Raises:
        ModelDirError: one line naming what is wrong with the draft model.
    """
    if config.method != DRAFT_MODEL or not config.model:
        return config
    try:
        draft = check_model_dir(config.model, tokenizer=False)
    except ModelDirError as e:
        raise ModelDirError(f"--speculative-config's draft model: {e}") from None
    vocab, target_vocab = _vocab_size(draft), _vocab_size(target_hf_config)
    if vocab != target_vocab:
        raise ModelDirError(f"--speculative-config's draft model {config.model} has a vocabulary of {vocab} tokens, "
                            f"the served model {target_vocab}: a draft model must share the served model's tokenizer")
    return msgspec.structs.replace(config, model=str(Path(config.model).absolute()))


def _vocab_size(hf_config: dict) -> int | None:
    return hf_config.get("vocab_size") or (hf_config.get("text_config") or {}).get("vocab_size")
