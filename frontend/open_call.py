"""A serving-core call chosen by its endpoint path, for transports that carry both kinds of request (the ZeroMQ
batch endpoint)."""

from __future__ import annotations

from typing import Any

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.chat_call import ChatCall
from shuttle.frontend.completion_call import CompletionCall
from shuttle.frontend.request.decoding import convert_body
from shuttle.frontend.request.protocol import ChatCompletionRequest, CompletionRequest
from shuttle.frontend.serving import Call
from shuttle.frontend.state import FrontendState

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
URLS = (COMPLETIONS_URL, CHAT_COMPLETIONS_URL)


def open_call(state: FrontendState, url: str, data: Any, background: bool = False) -> Call:
    """A body addressed by its endpoint path (`url`: /v1/completions or /v1/chat/completions), already parsed
    from JSON or msgpack into plain objects; for transports that carry either kind of request.

    Raises:
        InvalidRequestError: an unknown url (param "url") or an invalid body (param names the field).
        ModelNotFoundError: a model other than the served one.
    """
    if url == COMPLETIONS_URL:
        return CompletionCall(state, convert_body(data, CompletionRequest), "cmpl", background)
    if url == CHAT_COMPLETIONS_URL:
        return ChatCall(state, convert_body(data, ChatCompletionRequest), "chatcmpl", background)
    raise InvalidRequestError(f"url must be one of {', '.join(URLS)}, got {url!r}", param="url")
