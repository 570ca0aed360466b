"""What every reasoning parser shares: a model's output split into its thinking (`reasoning`) and its answer
(`content`) at the tags the model writes around its thinking, whole or streamed.

The rules (vLLM's, which its `<think>` parsers follow, made one rule for a whole output and a stream):
- The thinking ends at the first end tag (`</think>`); what follows is the answer. An output without it was cut
  while thinking (or the model never stopped): all of it is reasoning and the content is None.
- The first start tag (`<think>`) before that end is dropped; text before it is reasoning too (a template that
  opens the thinking in the prompt has the model write no start tag at all).
- A request whose prompt has already ended the thinking (its last tag is an end tag, as Qwen3's template writes
  `<think>\\n\\n</think>` for enable_thinking: false) does not think: its whole output is content.
- Tags after the end are the answer's text.

Streamed, text that may still turn out to be a tag is held back, so the pieces of any split of one text add up to
what `split` returns for it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ReasoningPiece:
    """What one streamed delta released: thinking text and answer text (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One output's incremental splitter: `feed` every text delta in order, then `finish` once.

    Args:
        start_tag, end_tag: the texts of the tokens that open and close the thinking.
        thinking: whether the output starts inside the thinking (False: all of it is content).
    """

    def __init__(self, start_tag: str, end_tag: str, thinking: bool):
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.in_reasoning = thinking
        self.ended = False  # the end tag was seen: everything after is content
        self._start_dropped = False
        self._held = ""

    def feed(self, text: str) -> ReasoningPiece:
        """Add the next delta's text; returns what is certain now."""
        if not self.in_reasoning:
            return ReasoningPiece(content=text)
        buffer = self._held + text
        reasoning = []
        while True:
            end = buffer.find(self.end_tag)
            start = -1 if self._start_dropped else buffer.find(self.start_tag)
            if start >= 0 and (end < 0 or start < end):
                reasoning.append(buffer[:start])
                buffer = buffer[start + len(self.start_tag):]
                self._start_dropped = True
                continue
            if end >= 0:
                reasoning.append(buffer[:end])
                self.in_reasoning, self.ended, self._held = False, True, ""
                return ReasoningPiece("".join(reasoning), buffer[end + len(self.end_tag):])
            keep = self._partial_tag(buffer)
            self._held = buffer[len(buffer) - keep:] if keep else ""
            reasoning.append(buffer[:len(buffer) - keep])
            return ReasoningPiece("".join(reasoning))

    def finish(self) -> ReasoningPiece:
        """The output ended: text held as a possible tag never became one; it is reasoning."""
        held, self._held = self._held, ""
        return ReasoningPiece(reasoning=held) if self.in_reasoning else ReasoningPiece()

    def _partial_tag(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a tag still to come."""
        tags = [self.end_tag] if self._start_dropped else [self.end_tag, self.start_tag]
        best = 0
        for tag in tags:
            for length in range(min(len(tag) - 1, len(buffer)), best, -1):
                if buffer.endswith(tag[:length]):
                    best = length
                    break
        return best


class ReasoningParser:
    """A reasoning model's thinking format: the tags around its thinking and their token ids in this model's
    tokenizer (the end tag's id is where a structured output's grammar starts, worker/grammar.py).

    Args:
        start_id, end_id: the token ids of `start_tag` and `end_tag` (each one token of the vocabulary).
    """

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, start_id: int, end_id: int):
        self.start_id = start_id
        self.end_id = end_id

    def prompt_ends_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt has ended the thinking already: its last tag token is the end tag (vLLM's
        is_reasoning_end on the prompt)."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.start_id:
                return False
            if token_id == self.end_id:
                return True
        return False

    def thinks(self, prompt_token_ids: list[int], chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether an output for this prompt starts inside the thinking."""
        return not self.prompt_ends_reasoning(prompt_token_ids)

    def stream(self, thinking: bool) -> ReasoningStream:
        """A splitter for one output (`thinking`: as `thinks` said for its prompt)."""
        return ReasoningStream(self.start_tag, self.end_tag, thinking)

    def split(self, text: str, thinking: bool) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content): reasoning None when the output does not think; content None when
        nothing follows the thinking (or it never ended)."""
        if not thinking:
            return None, text
        stream = self.stream(thinking)
        first, last = stream.feed(text), stream.finish()
        content = first.content + last.content
        return first.reasoning + last.reasoning, content if stream.ended and content else None

    def count_reasoning_tokens(self, token_ids: list[int], thinking: bool) -> int:
        """Output tokens of the thinking: those before the first end tag token, start tags not counted (all of
        them when it never ended; none when the output does not think)."""
        if not thinking:
            return 0
        end = token_ids.index(self.end_id) if self.end_id in token_ids else len(token_ids)
        return sum(1 for token_id in token_ids[:end] if token_id != self.start_id)
