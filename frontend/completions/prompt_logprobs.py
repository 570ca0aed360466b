"""vLLM's `prompt_logprobs` on /v1/completions and /v1/chat/completions: the request field checked as vLLM checks it,
and the response's list of one entry per prompt token (vLLM's shape, which OpenAI's API does not have)."""

from __future__ import annotations

from shuttle.common.errors import InvalidRequestError
from shuttle.common.messages import TokenLogprobs
from shuttle.frontend.tokenizer import TextTokenizer

ALL = -1  # prompt_logprobs: -1 asks for every token of the vocabulary (vLLM's sentinel)


def prompt_logprobs_of(value: int | None, stream: bool, limit: int, vocab_size: int) -> int | None:
    """How many alternatives per prompt token the engine computes (None: the request asks for no prompt logprobs).

    `value` is the request's prompt_logprobs: k >= 0 alternatives, or -1 for the whole vocabulary (k = vocab_size).
    As in vLLM, a stream takes only 0 (its chunks never carry prompt logprobs), and k is bounded by `limit`
    (common.sampling.logprobs_limit: the server's --max-logprobs within the vocabulary).

    Raises:
        InvalidRequestError: (param prompt_logprobs) below -1, with stream: true and not 0, or over `limit`.
    """
    if value is None:
        return None
    if stream and (value > 0 or value == ALL):
        raise InvalidRequestError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if value < 0 and value != ALL:
        raise InvalidRequestError("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
    k = vocab_size if value == ALL else value
    if k > limit:
        asked = f"-1 (the whole vocabulary, {k})" if value == ALL else str(k)
        raise InvalidRequestError(f"Requested prompt logprobs of {asked}, which is greater than max allowed: "
                                  f"{limit}", param="prompt_logprobs")
    return k


def prompt_logprobs_list(tokenizer: TextTokenizer, prompt_token_ids: list[int], entries: list[TokenLogprobs],
                         as_token_ids: bool = False) -> list[dict[str, dict] | None]:
    """The response's `prompt_logprobs`: one entry per prompt token, the first null (nothing predicts it), each
    other a map from token id (a JSON key, so a string) to {"logprob", "rank", "decoded_token"}: the prompt token
    first, with its rank in the whole vocabulary, then the k most likely with ranks 1..k, the prompt token appearing
    once when it is among them (vLLM's order and ranks).

    `entries[i]` is the engine's record of prompt token i + 1 (common.messages.TokenLogprobs). `decoded_token` is
    the token's text as logprobs show it everywhere (frontend/tokenizer.py token_text), or "token_id:ID" with
    `as_token_ids` (--return-tokens-as-token-ids).
    """
    def decoded(token_id: int) -> str:
        return f"token_id:{token_id}" if as_token_ids else tokenizer.token_text(token_id)[0]

    out: list[dict[str, dict] | None] = [None]
    for token_id, lp in zip(prompt_token_ids[1:], entries):
        position = {str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decoded(token_id)}}
        for rank, (top_id, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
            position[str(top_id)] = {"logprob": value, "rank": rank, "decoded_token": decoded(top_id)}
        out.append(position)
    return out


def first_k(lp: TokenLogprobs, k: int) -> TokenLogprobs:
    """`lp` with only its k most likely alternatives: an echo with `logprobs` k shows k of them even where the
    request's prompt_logprobs asked the engine for more."""
    if len(lp.top_token_ids) <= k:
        return lp
    return TokenLogprobs(logprob=lp.logprob, top_token_ids=lp.top_token_ids[:k], top_logprobs=lp.top_logprobs[:k],
                         rank=lp.rank)
