"""OpenAI response shapes: choices, chunks and logprobs for completions and chat completions."""

from __future__ import annotations

from common.messages import TokenLogprobs
from frontend.tokenizer import TextTokenizer


def completion_logprobs(tokenizer: TextTokenizer, token_ids: list[int], logprobs: list[TokenLogprobs],
                        text_offset: int, text_length: int) -> dict:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs, text_offset.

    `text_offset` is where these tokens' text starts in the choice's whole text (cumulative across stream
    chunks) and `text_length` how long that text is; a token's offset advances by its own text, never past the
    end of the text it belongs to (a byte-fallback token has no text of its own until its character completes).
    """
    tokens = [tokenizer.token_text(t)[0] for t in token_ids]
    offsets, advanced = [], 0
    for token_id in token_ids:
        offsets.append(text_offset + min(advanced, text_length))
        advanced += len(tokenizer.token_bytes[token_id].decode(errors="ignore")) if tokenizer.token_bytes else 1
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{tokenizer.token_text(i)[0]: v for i, v in zip(lp.top_token_ids, lp.top_logprobs)}
                         for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: TextTokenizer, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
    """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""

    def entry(token_id: int, logprob: float) -> dict:
        text, raw = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(t, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                        for t, lp in zip(token_ids, logprobs)]}
