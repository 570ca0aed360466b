"""POST /tokenize and POST /detokenize (vLLM's shapes)."""

from __future__ import annotations

from aiohttp import web

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.chat_call import chat_prompt_ids
from shuttle.frontend.request.decoding import decode_body
from shuttle.frontend.request.protocol import DetokenizeRequest, TokenizeRequest
from shuttle.frontend.serving import check_model
from shuttle.frontend.state import STATE
from shuttle.frontend.web.server import request_body


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": str} or {"messages": [...], ...chat prompt fields} -> {"tokens": [...], "count": n,
    "max_model_len": m,
    "token_strs": [...] with return_token_strs, else null}. The same tokens a completion or chat completion with
    these fields would be given."""
    state = request.app[STATE]
    body = decode_body(await request_body(request), TokenizeRequest)
    check_model(state, body.model)
    max_model_len = state.config.model.max_model_len
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        ids = chat_prompt_ids(state, body, bool(body.add_special_tokens))
    else:
        _refuse_chat_fields(body)
        ids = state.tokenizer.encode(body.prompt, body.add_special_tokens is not False, max_model_len)
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.config.model.max_model_len,
                              "token_strs": state.tokenizer.token_strs(ids) if body.return_token_strs else None})


def _refuse_chat_fields(body: TokenizeRequest) -> None:
    """A prompt's tokens ignore the chat template's fields: one set to other than its default is refused by name.

    Raises:
        InvalidRequestError: naming the first such field.
    """
    for name, default in (("tools", None), ("add_generation_prompt", True), ("continue_final_message", False),
                          ("chat_template_kwargs", None), ("parse_special_tokens_in_content", False)):
        if getattr(body, name) != default:
            raise InvalidRequestError(f"{name} applies to messages (the chat template), not to a prompt", param=name)


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [...]} -> {"prompt": text}."""
    state = request.app[STATE]
    body = decode_body(await request_body(request), DetokenizeRequest)
    check_model(state, body.model)
    if not all(0 <= t < state.tokenizer.vocab_size for t in body.tokens):
        raise InvalidRequestError(f"tokens must be ids in [0, {state.tokenizer.vocab_size})", param="tokens")
    return web.json_response({"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)})
