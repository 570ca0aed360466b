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
    group_id: str = ""  # the client request this choice belongs to (fair shares of the running set)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    ttft_slo_ms: float = 0.0  # the request's own TTFT objective (0: the server's)
    background: bool = False  # batch work: the scheduler runs it behind every interactive request

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
        """Token ids and logprobs travel with their text: a token goes out with the delta that releases the first
        character of its text (a token whose text is still held, as a possible stop string or an unfinished
        character, waits). When a stop string ends the output, the tokens kept are those whose text starts before
        the stop string (with include_stop: before its end): a token that straddles the start of the stop string
        stays, since part of its text is in the output; the token that completes the stop string and any after it
        go. So text, token ids and logprobs of a choice always describe the same tokens."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
        min_tokens = self.sampling.min_tokens
        matcher = StopStringMatcher(self.stop, self.include_stop, protected=min_tokens > 0)
        text_length = 0  # characters the detokenizer has produced
        held: list[tuple[int, int, TokenLogprobs | None]] = []  # (start of its text, token id, logprobs) not yet out
        async for output in self.engine.generate(self.request_id, self.prompt_token_ids, self.sampling,
                                                 priority=self.priority, timeout=self.timeout,
                                                 group_id=self.group_id, ttft_slo_ms=self.ttft_slo_ms,
                                                 background=self.background):
            if self.metrics is not None:
                self.metrics.on_output(output)
            if output.finish_reason == FinishReason.ERROR:
                if self.metrics is not None and output.error_status in (400, 503) and not self.num_output_tokens:
                    self.metrics.on_rejected(output.error_status, output.rejection)
                self.finish_reason = "error"
                status = output.error_status or 500
                retry_after = None
                if status == 503:  # the scheduler's own estimate (an SLO refusal) beats the queue-drain estimate
                    retry_after = output.retry_after_s or self.engine.refusal_retry_after()
                raise GenerationError(status, output.error_message, retry_after)
            self.num_cached_tokens = output.num_cached_tokens
            if output.prompt_logprobs:
                self.prompt_logprobs = output.prompt_logprobs
            pieces = []
            for i, token_id in enumerate(output.new_token_ids):
                held.append((text_length, token_id, output.logprobs[i] if output.logprobs else None))
                piece = detokenizer.add([token_id])
                text_length += len(piece)
                if self.num_output_tokens + i + 1 == min_tokens:
                    matcher.protect(text_length)
                pieces.append(matcher.feed(piece))
                if matcher.stopped:
                    break
            self.num_output_tokens += len(output.new_token_ids)  # usage counts every token generated
            if matcher.stopped:
                self.finish_reason = "stop"
            elif output.finish_reason is not None:
                pieces.append(matcher.feed(detokenizer.flush()))
                pieces.append(matcher.flush())
                self.finish_reason = "stop" if matcher.stopped else output.finish_reason.openai_name
            text = "".join(pieces)
            if text or self.finish_reason is not None:
                # at a finish without a stop string every token goes, those whose text is empty included
                out = len(held) if self.finish_reason is not None and not matcher.stopped else \
                    sum(1 for start, _, _ in held if start < matcher.released)
                released, held = held[:out], held[out:]
                yield TextDelta(text, [t for _, t, _ in released], [lp for _, _, lp in released if lp is not None],
                                self.finish_reason)
            if self.finish_reason is not None:
                return  # for a stop string, leaving the engine's generator aborts the request
