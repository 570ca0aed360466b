"""OpenAI response shapes: choices, chunks and logprobs for completions and chat completions."""

from __future__ import annotations

import codecs

from shuttle.common.messages import TokenLogprobs
from shuttle.frontend.tokenizer import TextTokenizer


def top_alternatives(token_id: int, logprobs: TokenLogprobs) -> list[tuple[int, float]]:
    """(token id, logprob) of the k most likely tokens, most likely first, then the sampled token when it is not
    among them: k + 1 entries at most, and never none (vLLM's rule; with k = 0 just the sampled token)."""
    top = list(zip(logprobs.top_token_ids, logprobs.top_logprobs))
    if token_id not in logprobs.top_token_ids:
        top.append((token_id, logprobs.logprob))
    return top


def token_name(tokenizer: TextTokenizer, token_id: int, as_token_ids: bool = False) -> str:
    """How logprobs name a token: its text (TextTokenizer.token_text), or "token_id:ID" with `as_token_ids`
    (--return-tokens-as-token-ids, vLLM's form, which tells apart tokens that are no whole character)."""
    return f"token_id:{token_id}" if as_token_ids else tokenizer.token_text(token_id)[0]


def completion_logprobs(tokenizer: TextTokenizer, token_ids: list[int], logprobs: list[TokenLogprobs],
                        text_starts: list[int], echo_length: int, text_end: int, as_token_ids: bool = False) -> dict:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs, text_offset.
    `top_logprobs` maps token text to logprob (see top_alternatives). With `as_token_ids` every token, in `tokens`
    and as a `top_logprobs` key, is named "token_id:ID" (token_name); offsets still count the text's characters.

    A token's `text_offset` is where its text starts in the choice's whole text: after the echoed prompt
    (`echo_length` characters; 0 without echo), at its start in the output (`text_starts`, TextGeneration's
    TextDelta.text_starts: a byte-fallback token of a character starts where the character does), never past
    `text_end`, the end of the text sent so far (a token whose text is still held shows where that text will start).
    The same tokens get the same offsets streamed or not.
    """
    return {
        "tokens": [token_name(tokenizer, t, as_token_ids) for t in token_ids],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_name(tokenizer, i, as_token_ids): v for i, v in top_alternatives(t, lp)}
                         for t, lp in zip(token_ids, logprobs)],
        "text_offset": [min(echo_length + start, text_end) for start in text_starts],
    }


def prompt_logprobs_object(tokenizer: TextTokenizer, prompt_token_ids: list[int], prompt_logprobs: list[TokenLogprobs],
                           output: dict, echo_length: int, with_special: bool = False,
                           as_token_ids: bool = False) -> dict:
    """Prepend the echoed prompt's tokens to a completions logprobs object; the first prompt token has no logprob
    (null), as in OpenAI's legacy API. Prompt offsets count from the start of the echoed text (`echo_length`
    characters long). Each prompt token is listed as the text it shows in the echo (see echo_token_texts; a special
    token shows its own text when `with_special`, the echo of a token-id prompt), in `tokens` and as its own key in
    `top_logprobs`, or as "token_id:ID" with `as_token_ids` (token_name)."""
    texts = echo_token_texts(tokenizer, prompt_token_ids, with_special)
    first_text = 0 if with_special else next((i for i, t in enumerate(prompt_token_ids)
                                               if t not in tokenizer.special_ids), -1)

    def name(alternative: int, i: int) -> str:  # of an alternative to prompt token i
        if as_token_ids:
            return token_name(tokenizer, alternative, True)
        return texts[i] if alternative == prompt_token_ids[i] else _shown(tokenizer, alternative, i == first_text)

    tops: list[dict[str, float] | None] = [None]
    offsets: list[int] = []
    position = 0
    for i, (token_id, lp) in enumerate(zip(prompt_token_ids[1:], prompt_logprobs), start=1):
        tops.append({name(t, i): v for t, v in top_alternatives(token_id, lp)})
    # a byte-fallback token ("bytes:\\xNN") shows no character of its own: the character its run of bytes completes
    # counts once, at the token that completes it (an invalid byte as U+FFFD)
    characters = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token_id, text in zip(prompt_token_ids, texts):
        offsets.append(min(position, echo_length))
        if tokenizer.is_byte_token(token_id) and tokenizer.token_bytes is not None:
            position += len(characters.decode(tokenizer.token_bytes[token_id]))
        else:
            position += len(characters.decode(b"", final=True)) + len(text)
    names = [token_name(tokenizer, t, True) for t in prompt_token_ids] if as_token_ids else texts
    return {
        "tokens": names + output["tokens"],
        "token_logprobs": [None] + [lp.logprob for lp in prompt_logprobs] + output["token_logprobs"],
        "top_logprobs": tops + output["top_logprobs"],
        "text_offset": offsets + output["text_offset"],
    }


def echo_token_texts(tokenizer: TextTokenizer, token_ids: list[int], with_special: bool = False) -> list[str]:
    """What each token of an echoed prompt shows in the echoed text: a special token (BOS) nothing, since decoding
    skips it, or with `with_special` its own text ("<s>", the echo of a token-id prompt keeps it); the first token
    with text without the leading space the decoder drops at the start of a text; a byte-fallback token
    "bytes:\\xNN" (one byte of a character, as in logprobs everywhere)."""
    texts, started = [], False
    for token_id in token_ids:
        if token_id in tokenizer.special_ids and not with_special:
            texts.append("")
            continue
        texts.append(_shown(tokenizer, token_id, not started))
        started = True
    return texts


def _shown(tokenizer: TextTokenizer, token_id: int, at_start: bool) -> str:
    text = tokenizer.token_text(token_id)[0]
    return text[1:] if at_start and tokenizer.strips_leading_space and text.startswith(" ") else text


def chat_logprobs(tokenizer: TextTokenizer, token_ids: list[int], logprobs: list[TokenLogprobs],
                  as_token_ids: bool = False) -> dict:
    """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}. Each
    `top_logprobs` holds exactly the top_logprobs most likely tokens, as OpenAI's and vLLM's chat do (an empty list
    for 0); the sampled token is the entry's own, not added to them as the completions API adds it. With
    `as_token_ids` each token is "token_id:ID" and its `bytes` that string's UTF-8, as vLLM writes them."""

    def entry(token_id: int, logprob: float) -> dict:
        if as_token_ids:
            name = token_name(tokenizer, token_id, True)
            return {"token": name, "logprob": logprob, "bytes": list(name.encode())}
        text, raw = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(t, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                        for t, lp in zip(token_ids, logprobs)]}
