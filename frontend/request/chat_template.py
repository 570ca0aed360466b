"""Chat messages to a prompt through the model's Jinja chat template (rendered by transformers' renderer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, cast

from transformers.utils import chat_template_utils

from shuttle.common.arg_types import chat_template_text
from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.request.protocol import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's; others go to the template as they are
# Names the renderer itself passes to the template: chat_template_kwargs may not set them.
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                             "chat_template", "conversations", "return_assistant_tokens_mask"})
# transformers annotates it `-> str` (it returns the rendered texts and the generation indices) and its tools as a
# list[dict | Callable] (invariant: a list[dict] is refused), so it is typed here as what its code does
render_jinja_template = cast(Callable[..., tuple[list[str], Any]], chat_template_utils.render_jinja_template)


class ChatTemplate:
    """The chat template of tokenizer_config.json, or `template_file` when given (--chat-template: a file, or the
    template itself).

    Raises:
        argparse.ArgumentTypeError: template_file is neither a readable file nor a template.
    """

    def __init__(self, model_dir: str, template_file: str | None = None):
        config_path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        # --chat-template: a file or the template itself (common/arg_types.py)
        template = chat_template_text(template_file) if template_file else config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.template: str | None = template

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
               escape: Callable[[str], str] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for `messages`. An assistant message's tool calls reach the template with each call's
        arguments decoded to an object (as vLLM passes them: templates `tojson` them); a tool message carries its
        tool_call_id, and any message its name.

        Args:
            add_generation_prompt: end with the template's opening of an assistant turn.
            continue_final_message: end inside the last message (no end-of-turn after it), so the model continues
                it, e.g. an assistant prefix (transformers' rule; vLLM's parameter). Excludes add_generation_prompt.
            template_kwargs: extra variables for the template (vLLM's chat_template_kwargs).
            escape: applied to every message's content (SpecialTextGuard.escape), None to leave it as is.
            tools: the request's tools in OpenAI's shape (frontend/tools/request.py template_tools), or None.

        Raises:
            InvalidRequestError: no template, empty or malformed messages, a message without content, tool-call
                arguments that are not a JSON object, conflicting options, or the template refused them.
        """
        if self.template is None:
            raise InvalidRequestError("this model has no chat template; start the server with --chat-template FILE "
                                      "or use /v1/completions", param="messages")
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message continues the last message, so it needs "
                                      "add_generation_prompt: false", param="continue_final_message")
        reserved = sorted(RESERVED_KWARGS & (template_kwargs or {}).keys())
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)} (use the request "
                                      f"fields)", param="chat_template_kwargs")
        conversation = [_template_message(i, message, escape) for i, message in enumerate(messages)]
        try:
            rendered, _ = render_jinja_template(
                conversations=[conversation], tools=tools, chat_template=self.template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **{**self.special, **(template_kwargs or {})})
        except Exception as exc:  # jinja2 errors and raise_exception() in the template
            raise InvalidRequestError(f"the chat template could not render these messages: {exc}",
                                      param="messages") from None
        return rendered[0]


def _template_message(i: int, message: ChatMessage, escape: Callable[[str], str] | None) -> dict[str, Any]:
    """Message `i` as the template reads it.

    Raises:
        InvalidRequestError: an empty role, no content (allowed only beside an assistant's tool_calls), or a tool
            call whose arguments are not a JSON object.
    """
    if not message.role:  # any other role goes to the template, which may refuse it (vLLM's rule)
        raise InvalidRequestError(f"messages[{i}] has an empty role", param="messages")
    calls = message.tool_calls if message.role == "assistant" else None
    if message.tool_calls and not calls:
        raise InvalidRequestError(f"messages[{i}] is a {message.role} message: only assistant messages have "
                                  f"tool_calls", param="messages")
    if message.content is None and not calls:
        raise InvalidRequestError(f"messages[{i}] has no content: content is required", param="messages")
    content = "" if message.content is None else _text_content(message.content)
    out: dict[str, Any] = {"role": message.role, "content": escape(content) if escape else content}
    if message.name is not None:
        out["name"] = message.name
    if calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": _arguments(i, j, call.function.arguments)}}
                             for j, call in enumerate(calls)]
    if message.role == "tool" and message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    thought = message.reasoning if message.reasoning is not None else message.reasoning_content
    if thought is not None:  # templates read reasoning_content (Qwen3's, DeepSeek's); vLLM's newer name too
        out["reasoning"] = out["reasoning_content"] = escape(thought) if escape else thought
    return out


def arguments_object(text: str) -> dict[str, Any] | None:
    """A tool call's arguments as the chat template reads them (an object), or None when `text` is no JSON object."""
    try:
        arguments = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return arguments if isinstance(arguments, dict) else None


def _arguments(i: int, j: int, text: str) -> dict[str, Any]:
    arguments = arguments_object(text)
    if arguments is None:
        raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object as text",
                                  param="messages")
    return arguments


def _text_content(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                                      param="messages")
        parts.append(part["text"])
    return "\n".join(parts)  # as vLLM joins a message's text parts


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
