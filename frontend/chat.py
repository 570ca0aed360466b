"""Chat messages to a prompt through the model's Jinja chat template (rendered by transformers' renderer)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

from common.errors import InvalidRequestError
from frontend.protocol import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplate:
    """The chat template of tokenizer_config.json, or the one in `template_file` when given.

    Raises:
        OSError: template_file cannot be read.
    """

    def __init__(self, model_dir: str, template_file: str | None = None):
        config_path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        template = Path(template_file).read_text() if template_file else config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.template: str | None = template

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt text for `messages`, ending with the assistant's generation prompt.

        Raises:
            InvalidRequestError: no template, empty or malformed messages, or the template refused them.
        """
        if self.template is None:
            raise InvalidRequestError("this model has no chat template; start the server with --chat-template FILE "
                                      "or use /v1/completions", param="messages")
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        conversation = []
        for message in messages:
            if message.role not in ROLES:
                raise InvalidRequestError(f"message role must be one of {', '.join(ROLES)}", param="messages")
            conversation.append({"role": message.role, "content": _text_content(message.content)})
        try:
            rendered, _ = render_jinja_template(conversations=[conversation], chat_template=self.template,
                                                add_generation_prompt=True, **self.special)
        except Exception as exc:  # jinja2 errors and raise_exception() in the template
            raise InvalidRequestError(f"the chat template could not render these messages: {exc}",
                                      param="messages") from None
        return rendered[0]


def _text_content(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                                      param="messages")
        parts.append(part["text"])
    return "".join(parts)


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
