"""qwen3: Qwen3's `<think>...</think>`, switched off per request by chat_template_kwargs {"enable_thinking": false}."""

from __future__ import annotations

from typing import Any

from shuttle.frontend.reasoning.base import ReasoningParser


class Qwen3Parser(ReasoningParser):
    """The base rules, except that a request with chat_template_kwargs enable_thinking false does not think: its whole
    output is content (Qwen3's template then ends the thinking in the prompt; vLLM's qwen3 parser reads the flag too,
    for templates that do not)."""

    name = "qwen3"

    def thinks(self, prompt_token_ids: list[int], chat_template_kwargs: dict[str, Any] | None) -> bool:
        if (chat_template_kwargs or {}).get("enable_thinking", True) is False:
            return False
        return super().thinks(prompt_token_ids, chat_template_kwargs)
