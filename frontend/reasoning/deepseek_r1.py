"""deepseek_r1: DeepSeek-R1's `<think>...</think>` (its chat template opens the thinking in the prompt, so the model
often writes no `<think>`; an output that never writes `</think>` is all reasoning)."""

from __future__ import annotations

from shuttle.frontend.reasoning.base import ReasoningParser


class DeepSeekR1Parser(ReasoningParser):
    """The base rules as they are (frontend/reasoning/base.py)."""

    name = "deepseek_r1"
