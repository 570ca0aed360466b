"""A chat response's choices split into thinking and answer (frontend/chat_call.py's ChatCall and the Responses API
ask this module): whole (`split`) or each streamed choice's splitter (`delta`, fed every text delta of a choice in
order, its last one with `last`)."""

from __future__ import annotations

from shuttle.frontend.reasoning.base import ReasoningParser, ReasoningPiece, ReasoningStream


class ReasoningChoices:
    """One response's reasoning split.

    Args:
        parser: the server's --reasoning-parser.
        thinking: whether this request's outputs start inside the thinking (ReasoningParser.thinks of its prompt).
    """

    def __init__(self, parser: ReasoningParser, thinking: bool):
        self.parser = parser
        self.thinking = thinking
        self._streams: dict[int, ReasoningStream] = {}

    @property
    def grammar_starts_after(self) -> int | None:
        """The token after which a structured output's grammar applies: the end tag's, while the output thinks."""
        return self.parser.end_id if self.thinking else None

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole choice's (reasoning, content) (see ReasoningParser.split)."""
        return self.parser.split(text, self.thinking)

    def delta(self, index: int, text: str, last: bool) -> ReasoningPiece:
        """What choice `index`'s next text delta releases (with `last`, the held-back rest too)."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self.parser.stream(self.thinking)
        piece = stream.feed(text)
        if last:
            rest = stream.finish()
            piece = ReasoningPiece(piece.reasoning + rest.reasoning, piece.content + rest.content)
        return piece

    def answering(self, index: int) -> bool:
        """Whether streamed choice `index` has left its thinking (its answer, and any tool call, may come)."""
        stream = self._streams.get(index)
        return not (stream.in_reasoning if stream is not None else self.thinking)

    def count_tokens(self, token_ids: list[int]) -> int:
        """Output tokens of a choice's thinking (usage's reasoning_tokens)."""
        return self.parser.count_reasoning_tokens(token_ids, self.thinking)


def reasoning_fields(reasoning: str | None) -> dict:
    """A message's or delta's thinking under both names clients read: `reasoning` (vLLM's since 0.11) and
    `reasoning_content` (DeepSeek's API, and vLLM's before)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}
