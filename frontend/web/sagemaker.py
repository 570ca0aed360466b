"""POST /invocations, SageMaker's inference route: the body goes to the endpoint its shape names, as vLLM routes it
(a chat first, then a completion): one with the key `messages` is a chat completion, else one with the key `prompt` a
completion, whatever their values (null included: that endpoint then refuses it by name). Any other body is a 400
naming what it lacks. (GET and POST /ping, SageMaker's health route, are /health's
handler: frontend/app.py.)
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.completions.routes import create_chat_completion, create_completion
from shuttle.frontend.web.off_loop import convert
from shuttle.frontend.web.server import request_body


class _Shape(msgspec.Struct):
    """The two keys a body is routed by, their values left undecoded (UNSET: the key is absent; vLLM routes on the
    key's presence, so a null value still names the endpoint)."""

    messages: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    prompt: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


def route_of(body: bytes) -> str:
    """The endpoint an /invocations body goes to: "chat" (it has `messages`) or "completion" (it has `prompt`).

    Raises:
        InvalidRequestError: the body is not a JSON object, or has neither key.
    """
    try:
        shape = msgspec.json.decode(body, type=_Shape)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"POST /invocations takes a JSON object: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if shape.messages is not msgspec.UNSET:
        return "chat"
    if shape.prompt is not msgspec.UNSET:
        return "completion"
    raise InvalidRequestError("POST /invocations routes a body by its shape: 'messages' makes it a chat completion, "
                              "'prompt' a completion; this body has neither")


async def invocations(request: web.Request) -> web.StreamResponse:
    """POST /invocations: the chat completion or completion its body names (route_of), answered as that endpoint
    answers it, streams included."""
    raw = await request_body(request)
    route = await convert(lambda: route_of(raw), len(raw))
    return await (create_chat_completion if route == "chat" else create_completion)(request)
