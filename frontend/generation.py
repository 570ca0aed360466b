"""One request's life in the frontend: submit, detokenize incrementally, count tokens, end exactly once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from common.messages import FinishReason
from common.sampling import SamplingParams
from frontend.engine_client import EngineClient
from frontend.tokenizer import IncrementalDetokenizer, TextTokenizer


class GenerationError(Exception):
    """The request ended with an error output from the scheduler (status: HTTP-like code)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class TextDelta:
    """New text and the token ids that produced it; `finish_reason` ("stop", "length", "abort") on the last."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class TextGeneration:
    """Drives one request through the engine and keeps its usage counts.

    Attributes:
        prompt_token_ids: the tokenized prompt.
        num_output_tokens: tokens generated so far (the end-of-sequence token included, as OpenAI counts).
        num_cached_tokens: prompt tokens the scheduler found in the prefix cache.
    """

    engine: EngineClient
    tokenizer: TextTokenizer
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    timeout: float = 0.0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    _pending_ids: list[int] = field(default_factory=list)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Yield text deltas until the request finishes.

        Raises:
            GenerationError: the scheduler rejected or failed the request.
        """
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
        async for output in self.engine.generate(self.request_id, self.prompt_token_ids, self.sampling,
                                                self.priority, self.timeout):
            if output.finish_reason == FinishReason.ERROR:
                raise GenerationError(output.error_status or 500, output.error_message)
            self.num_output_tokens += len(output.new_token_ids)
            self.num_cached_tokens = output.num_cached_tokens
            self._pending_ids.extend(output.new_token_ids)
            text = detokenizer.add(output.new_token_ids)
            if output.finish_reason is not None:
                text += detokenizer.flush()
                self.finish_reason = output.finish_reason.openai_name
            if text or self.finish_reason is not None:
                ids, self._pending_ids = self._pending_ids, []
                yield TextDelta(text, ids, self.finish_reason)

    def usage(self) -> dict:
        """OpenAI `usage` object."""
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.num_output_tokens,
                "total_tokens": prompt + self.num_output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}
