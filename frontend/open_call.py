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

    The call is answered with one body (Call.collect), so a body asking to stream is refused rather than answered
    unstreamed.

    Raises:
        InvalidRequestError: an unknown url (param "url"), an invalid body (param names the field), or `stream`
            true (param "stream").
        ModelNotFoundError: a model other than the served one.
    """
    body: CompletionRequest | ChatCompletionRequest
    if url == COMPLETIONS_URL:
        body = convert_body(data, CompletionRequest)
    elif url == CHAT_COMPLETIONS_URL:
        body = convert_body(data, ChatCompletionRequest)
    else:
        raise InvalidRequestError(f"url must be one of {', '.join(URLS)}, got {url!r}", param="url")
    if body.stream:
        raise InvalidRequestError("stream is not supported here: each job is answered with one body (stream over "
                                  "HTTP or the WebSocket)", param="stream")
    if isinstance(body, CompletionRequest):
        return CompletionCall(state, body, "cmpl", background)
    return ChatCall(state, body, "chatcmpl", background)
