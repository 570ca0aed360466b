"""One sequence's life in the frontend: submit, detokenize incrementally, apply stop strings, count tokens."""

from __future__ import annotations

import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncGenerator

from shuttle.common.errors import GenerationError
from shuttle.common.messages import CONSTRAINT_REFUSAL, NEVER_FITS, FinishReason, RequestOutput, Submit, TokenLogprobs
from shuttle.frontend.engine.api import Engine
from shuttle.frontend.observability.metrics import RequestMetrics
from shuttle.frontend.stop import StopStringMatcher
from shuttle.frontend.tokenizer import IncrementalDetokenizer, TextTokenizer

log = logging.getLogger("shuttle.frontend")


@dataclass
class TextDelta:
    """New text of choice `index`, the token ids that produced it and their logprobs; `finish_reason` on the last.
    `text_starts`: where each token's text starts in the choice's whole text (characters; a byte-fallback token of
    an unfinished character starts where that character will, the token after it one character on)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    index: int = 0
    text_starts: list[int] = field(default_factory=list)


@dataclass
class TextGeneration:
    """Drives one sequence (one choice) through the engine and keeps its usage counts.

    Attributes:
        request: what the engine is asked (its id, prompt, sampling, priority, timeout, group, objective).
        index: the choice index in the response.
        stop: stop strings; the output ends right before the first one found (finish_reason "stop").
        num_output_tokens: tokens generated (the end-of-sequence token included, as OpenAI counts).
        num_cached_tokens: prompt tokens the scheduler found in the prefix cache.
    """

    engine: Engine
    tokenizer: TextTokenizer
    request: Submit
    index: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    metrics: RequestMetrics | None = None
    # the fields an engine's 400 names: (the output constraint's, max_tokens'): a constraint that does not compile,
    # or a prompt + max_tokens that no cache could hold
    refusal_params: tuple[str | None, str] = (None, "max_tokens")
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    log_requests: bool = False  # --enable-log-requests: a line when the sequence is submitted, and when it ends
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    group: int | None = None  # the serving group it went to (data parallel), once submitted
    prompt_token_ids: list[int] = field(init=False)  # the request's
    # decoding state of `deltas`: text so far, stop strings, and tokens whose text is still held
    _detokenizer: IncrementalDetokenizer | None = field(default=None, init=False, repr=False)
    _matcher: StopStringMatcher | None = field(default=None, init=False, repr=False)
    _text_length: int = field(default=0, init=False, repr=False)  # characters the detokenizer has produced
    _last_token: int | None = field(default=None, init=False, repr=False)  # the last token the engine sent
    # (start of its text, token id, logprobs) of each token not yet out
    _held: list[tuple[int, int, TokenLogprobs | None]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        self.prompt_token_ids = self.request.prompt_token_ids

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output (None: it ended otherwise, or has not ended)."""
        return self._matcher.matched if self._matcher is not None else None

    @property
    def stopped_by_request(self) -> bool:
        """Whether a stop the request set ended the output (a stop string, or one of its stop_token_ids), rather than
        the model's own end (an end-of-sequence token, a finished grammar) or a length: the output was cut."""
        return self.finish_reason == "stop" and (
            self.stop_string is not None or self._last_token in self.request.sampling.stop_token_ids)

    async def deltas(self) -> AsyncGenerator[TextDelta, None]:
        """Yield text deltas until the sequence finishes; leaving early aborts it in the scheduler.

        Token ids and logprobs travel with their text: a token goes out with the delta that releases the first
        character of its text (a token whose text is still held, as a possible stop string or an unfinished
        character, waits). When a stop string ends the output, the tokens kept are those whose text starts before
        the stop string (with include_stop: before its end): a token that straddles the start of the stop string
        stays, since part of its text is in the output; the token that completes the stop string and any after it
        go. So text, token ids and logprobs of a choice always describe the same tokens.

        Raises:
            GenerationError: the scheduler rejected or failed the request.
        """
        self.begin()
        if self.metrics is not None:
            self.metrics.on_submit(self.request)
        try:
            generating = self.engine.generate(self.request)
            self.group = getattr(self.engine, "last_group", None)  # a data-parallel router's choice
            if self.metrics is not None:
                self.metrics.group = self.group
            if self.log_requests:  # never the prompt's text
                log.info("request %s: %d prompt tokens, %s", self.request.request_id, len(self.prompt_token_ids),
                         self.request.sampling, extra={"request_id": self.request.request_id, "group": self.group})
            async with aclosing(generating) as outputs:
                async for output in outputs:
                    delta = self.advance(output)
                    if delta is not None:
                        yield delta
                    if self.finish_reason is not None:
                        return  # for a stop string, closing the engine's generator aborts the request
        finally:
            if self.metrics is not None:
                self.metrics.on_finish(self.finish_reason or "abort")
            if self.log_requests:
                log.info("request %s finished: %s, %d output tokens", self.request.request_id,
                         self.finish_reason or "abort", self.num_output_tokens,
                         extra={"request_id": self.request.request_id, "group": self.group})

    def begin(self) -> None:
        """Start decoding afresh (detokenizer, stop strings): deltas() does, and so does a driver that runs the engine
        itself and hands each output to advance() (offline/llm.py)."""
        self._detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
        self._matcher = StopStringMatcher(self.stop, self.include_stop, protected=self.request.sampling.min_tokens > 0)

    def advance(self, output: RequestOutput) -> TextDelta | None:
        """Take one output (after begin()): the delta it releases (None when all its text is still held);
        finish_reason once the sequence has finished (the scheduler said so, or a stop string ended it).

        Raises:
            GenerationError: an error output.
        """
        if self.metrics is not None:
            self.metrics.on_output(output)
        if output.finish_reason == FinishReason.ERROR:
            raise self._error(output)
        self.num_cached_tokens = output.num_cached_tokens
        if output.new_token_ids:
            self._last_token = output.new_token_ids[-1]
        if output.prompt_logprobs:
            self.prompt_logprobs = output.prompt_logprobs
        matcher, detokenizer, held = self._matcher, self._detokenizer, self._held
        assert matcher is not None and detokenizer is not None  # made by begin()
        pieces = []
        # the stop token that ended the sequence (an end-of-sequence or stop_token_ids id) counts and travels in
        # token_ids, but its text is not output unless include_stop_str_in_output (vLLM's rule): a plain-text EOS
        # from generation_config would otherwise end a JSON answer with a stray word
        stop_token = len(output.new_token_ids) - 1 if output.finish_reason == FinishReason.STOP and \
            not self.include_stop else -1
        consumed = 0
        for i, token_id in enumerate(output.new_token_ids):
            held.append((self._text_length, token_id, output.logprobs[i] if output.logprobs else None))
            piece = "" if i == stop_token else detokenizer.add([token_id])
            self._text_length += len(piece)
            consumed = i + 1
            if self.num_output_tokens + i + 1 == self.request.sampling.min_tokens:
                matcher.protect(self._text_length)
            pieces.append(matcher.feed(piece))
            if matcher.stopped:
                break
        # usage counts every token generated up to the one that completed a stop string: an output carrying several
        # (accepted speculative drafts) counts as the same tokens arriving one by one would
        self.num_output_tokens += consumed
        if matcher.stopped:
            self.finish_reason = "stop"
        elif output.finish_reason is not None:
            pieces.append(matcher.feed(detokenizer.flush()))
            pieces.append(matcher.flush())
            self.finish_reason = "stop" if matcher.stopped else output.finish_reason.openai_name
        text = "".join(pieces)
        if not text and self.finish_reason is None:
            return None
        # at a finish without a stop string every token goes, those whose text is empty included
        out = len(held) if self.finish_reason is not None and not matcher.stopped else \
            sum(1 for start, _, _ in held if start < matcher.released)
        released, self._held = held[:out], held[out:]
        return TextDelta(text, [t for _, t, _ in released], [lp for _, _, lp in released if lp is not None],
                         self.finish_reason, self.index, [start for start, _, _ in released])

    def _error(self, output: RequestOutput) -> GenerationError:
        """The GenerationError of an error output (a refusal at arrival counted as such)."""
        if self.metrics is not None and output.error_status in (400, 503) and not self.num_output_tokens:
            self.metrics.on_rejected(output.error_status, output.rejection)
        self.finish_reason = "error"
        status = output.error_status or 500
        retry_after = None
        if status == 503:  # the scheduler's own estimate (an SLO refusal) beats the queue-drain estimate
            retry_after = output.retry_after_s or self.engine.refusal_retry_after()
        param = None
        if status == 400:
            constraint, length = self.refusal_params
            message = output.error_message
            param = constraint if CONSTRAINT_REFUSAL in message else length if NEVER_FITS in message else \
                "ttft_slo_ms" if output.rejection == "slo" and "its ttft_slo_ms" in message else None
        return GenerationError(status, output.error_message, retry_after, param)
