"""Reasoning models (`--reasoning-parser`): a model's thinking split out of its output as `reasoning_content`
(chat), a `reasoning` output item (Responses), and the point after which a structured output's grammar applies.

`PARSERS` holds the formats a user can pick; `reasoning_parser_of` builds the server's one for its tokenizer.
"""

from __future__ import annotations

import logging

from shuttle.frontend.reasoning.base import ReasoningParser, ReasoningPiece, ReasoningStream
from shuttle.frontend.reasoning.deepseek_r1 import DeepSeekR1Parser
from shuttle.frontend.reasoning.qwen3 import Qwen3Parser
from shuttle.frontend.tokenizer import TextTokenizer

log = logging.getLogger("shuttle.frontend")

PARSERS: dict[str, type[ReasoningParser]] = {DeepSeekR1Parser.name: DeepSeekR1Parser, Qwen3Parser.name: Qwen3Parser}


def reasoning_parser_of(name: str | None, tokenizer: TextTokenizer) -> ReasoningParser | None:
    """The --reasoning-parser `name` for this tokenizer; None without one, and None (logged once, at start-up) when
    the tokenizer has no single token for either tag: such a model cannot write the tags its thinking would need,
    so its output is served as content and a structured output constrains all of it. (vLLM refuses to start then;
    shuttle serves, so that one command line serves every model.)

    Raises:
        ValueError: an unknown name (the flag's choices make this a bug).
    """
    if name is None:
        return None
    parser_class = PARSERS.get(name)
    if parser_class is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    start_id, end_id = tokenizer.token_id(parser_class.start_tag), tokenizer.token_id(parser_class.end_tag)
    if start_id is None or end_id is None:
        missing = " and ".join(tag for tag, token_id in ((parser_class.start_tag, start_id),
                                                          (parser_class.end_tag, end_id)) if token_id is None)
        log.warning("--reasoning-parser %s: the model's tokenizer has no %s token, so the model cannot mark its "
                    "thinking: its whole output is served as content", name, missing)
        return None
    return parser_class(start_id, end_id)


__all__ = ["PARSERS", "DeepSeekR1Parser", "Qwen3Parser", "ReasoningParser", "ReasoningPiece", "ReasoningStream",
           "reasoning_parser_of"]
