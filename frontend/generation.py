"""One sequence's life in the frontend: submit, detokenize incrementally, apply stop strings, count tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from common.errors import GenerationError
from common.messages import FinishReason, TokenLogprobs
from common.sampling import SamplingParams
from frontend.engine_client import EngineClient
from frontend.metrics import RequestMetrics
from frontend.stop import StopStringMatcher
from frontend.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass
class TextDelta:
    """New text, the token ids that produced it and their logprobs; `finish_reason` on the last delta."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None


@dataclass
class TextGeneration:
    """Drives one sequence (one choice) through the engine and keeps its usage counts.

    Attributes:
        index: the choice index in the response.
        stop: stop strings; the output ends right before the first one found (finish_reason "stop").
        num_output_tokens: tokens generated (the end-of-sequence token included, as OpenAI counts).
        num_cached_tokens: prompt tokens the scheduler found in the prefix cache.
    """

    engine: EngineClient
    tokenizer: TextTokenizer
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    index: int = 0
    priority: int = 0
    timeout: float = 0.0
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    ttft_slo_ms: float = 0.0  # the request's own TTFT objective (0: the server's)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Yield text deltas until the sequence finishes; leaving early aborts it in the scheduler.

        Raises:
            GenerationError: the scheduler rejected or failed the request.
        """
        try:
            async for delta in self._deltas():
                yield delta
        finally:
            if self.metrics is not None:
                self.metrics.on_finish(self.finish_reason or "abort")

    async def _deltas(self) -> AsyncIterator[TextDelta]:
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
        matcher = StopStringMatcher(self.stop, self.include_stop)
        pending_ids: list[int] = []
        pending_logprobs: list[TokenLogprobs] = []
        async for output in self.engine.generate(self.request_id, self.prompt_token_ids, self.sampling,
                                                 self.priority, self.timeout, ttft_slo_ms=self.ttft_slo_ms):
            if self.metrics is not None:
                self.metrics.on_output(output)
            if output.finish_reason == FinishReason.ERROR:
                if self.metrics is not None and output.error_status in (400, 503) and not self.num_output_tokens:
                    self.metrics.on_rejected(output.error_status, output.rejection)
                self.finish_reason = "error"
                raise GenerationError(output.error_status or 500, output.error_message, output.retry_after_s)
            self.num_output_tokens += len(output.new_token_ids)
            self.num_cached_tokens = output.num_cached_tokens
            if output.prompt_logprobs:
                self.prompt_logprobs = output.prompt_logprobs
            pending_ids.extend(output.new_token_ids)
            pending_logprobs.extend(output.logprobs)
            text = matcher.feed(detokenizer.add(output.new_token_ids))
            if matcher.stopped:
                self.finish_reason = "stop"
            elif output.finish_reason is not None:
                text += matcher.feed(detokenizer.flush())
                text += matcher.flush()
                self.finish_reason = "stop" if matcher.stopped else output.finish_reason.openai_name
            if text or self.finish_reason is not None:
                yield TextDelta(text, pending_ids, pending_logprobs, self.finish_reason)
                pending_ids, pending_logprobs = [], []
            if self.finish_reason is not None:
                return  # for a stop string, leaving the engine's generator aborts the request
