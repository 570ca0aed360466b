"""What the offline LLM returns, shaped as vLLM's RequestOutput, CompletionOutput and Logprob, and the prompt shapes it
takes besides a string (vLLM's TextPrompt and TokensPrompt)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from shuttle.common.messages import TokenLogprobs


class TextPrompt(TypedDict):
    """A prompt as text (vLLM's TextPrompt): tokenized with the model's tokenizer, BOS added as it adds it."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (vLLM's TokensPrompt), sent to the model as given."""

    prompt_token_ids: list[int]


@dataclass
class Logprob:
    """One token's log-probability (natural log) at a position.

    Attributes:
        rank: its place among the position's most likely tokens (1: the most likely; None: not among those returned).
        decoded_token: its text, as the server's logprobs show it.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one position: token id -> its Logprob (the sampled or prompt token, and the most likely ones)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One output sequence of a prompt.

    Attributes:
        index: its place among the prompt's n outputs.
        text: the generated text (a stop string, and the text of an end-of-sequence or stop token, left out).
        token_ids: the generated tokens (an end-of-sequence or stop token included; a stop string's last tokens not).
        cumulative_logprob: the sum of the sampled tokens' log-probabilities (None unless logprobs were asked for).
        logprobs: one PositionLogprobs per token of token_ids (None unless asked for).
        finish_reason: "stop" (end-of-sequence, a stop token or string) or "length" (max_tokens, or max_model_len).
        stop_reason: the stop string or stop token id that ended it (None: end-of-sequence, or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything one prompt produced.

    Attributes:
        request_id: the LLM's id of the prompt (a counter: "0", "1", ... over the LLM's life).
        prompt: the prompt's text (None for a TokensPrompt).
        prompt_token_ids: the ids the model was given.
        prompt_logprobs: with SamplingParams.prompt_logprobs: None for the first token, then one PositionLogprobs per
            prompt token.
        outputs: the n CompletionOutputs, by index.
        finished: True (generate returns when every prompt has finished).
        num_cached_tokens: prompt tokens found in the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: None = field(default=None, repr=False)  # vLLM's per-request timings: not recorded offline


def position_logprobs(token_id: int, logprobs: TokenLogprobs, token_text) -> PositionLogprobs:
    """One position's logprobs in vLLM's shape: the most likely tokens by rank, and `token_id` (sampled, or the
    prompt's) with its own rank when among them.

    Args:
        token_text: token id -> its display text (frontend/tokenizer.py TextTokenizer.token_text's first part).
    """
    position = {t: Logprob(lp, rank, token_text(t))
                for rank, (t, lp) in enumerate(zip(logprobs.top_token_ids, logprobs.top_logprobs), start=1)}
    if token_id not in position:
        position = {token_id: Logprob(logprobs.logprob, logprobs.rank or None, token_text(token_id)), **position}
    return position
