"""GET /tokenizer_info under --enable-tokenizer-info-endpoint (404 without it, as vLLM): the tokenizer's
configuration, in vLLM's shape.

vLLM answers with its tokenizer's init arguments, which are tokenizer_config.json's fields: so does shuttle, with
each special token written as its text (a `{"content": "<s>", ...}` object as "<s>", `added_tokens_decoder` as
{id: text}), the vocabulary file paths left out, `tokenizer_class` always present (PreTrainedTokenizerFast when
the file names none) and `chat_template` the template the server renders chats with (--chat-template's, else the
tokenizer's), when there is one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web

from shuttle.frontend.state import STATE

INFO = web.AppKey("shuttle_tokenizer_info", dict)
DROPPED = ("vocab_file", "merges_file")  # paths on the server's disk, as vLLM leaves them out


def tokenizer_info(tokenizer_dir: str, chat_template: str | None) -> dict[str, Any]:
    """The /tokenizer_info body for the tokenizer in `tokenizer_dir` (its tokenizer_config.json, when there is
    one) and the chat template the server renders with.

    Raises:
        OSError, json.JSONDecodeError: tokenizer_config.json exists but cannot be read as JSON.
    """
    path = Path(tokenizer_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    info = {name: _as_text(value) for name, value in config.items() if name not in DROPPED}
    info["tokenizer_class"] = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    if chat_template:
        info["chat_template"] = chat_template
    else:
        info.pop("chat_template", None)
    return info


def _as_text(value: Any) -> Any:
    """An added token's object as its text, through dicts and lists (vLLM's JSON of transformers' AddedToken)."""
    if isinstance(value, dict):
        if value.get("__type") == "AddedToken" or ("content" in value and "special" in value):
            return value.get("content")
        return {name: _as_text(item) for name, item in value.items()}
    if isinstance(value, list):
        return [_as_text(item) for item in value]
    return value


async def get_tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info: the body built at start-up (tokenizer_info)."""
    return web.json_response(request.app[INFO])


def add_tokenizer_info(app: web.Application) -> None:
    """Serve GET /tokenizer_info on `app` (its state's tokenizer and chat template), the body read now."""
    state = app[STATE]
    app[INFO] = tokenizer_info(state.config.model.tokenizer_dir or state.config.model.model_dir,
                               state.chat_template.template)
    app.router.add_get("/tokenizer_info", get_tokenizer_info)
