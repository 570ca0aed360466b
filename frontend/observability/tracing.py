"""OpenTelemetry tracing (`--otlp-traces-endpoint`): one span per sequence, exported over OTLP.

The span is vLLM's: named `llm_request`, of kind SERVER, from the request's arrival to its terminal outcome, a child of
the caller's span when the HTTP request carried a W3C `traceparent` header, with vLLM's attribute names
(vllm/tracing.py's SpanAttributes): gen_ai.request.id, gen_ai.response.model, gen_ai.request.max_tokens / temperature
/ top_p / n, gen_ai.usage.prompt_tokens / completion_tokens, gen_ai.latency.time_in_queue / time_to_first_token / e2e
/ time_in_model_prefill / time_in_model_decode / time_in_model_inference (seconds). shuttle adds
gen_ai.response.finish_reasons (the OpenTelemetry GenAI convention) and shuttle.group (the serving group). No prompt
or output text is ever put on a span.

The exporter follows the OpenTelemetry SDK's own environment: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL `grpc` (the default,
as vLLM's) or `http/protobuf`, OTEL_EXPORTER_OTLP_TRACES_INSECURE, OTEL_SERVICE_NAME (default "shuttle"), and so on.
The SDK is the optional extra `shuttle[otel]`; without it, the flag is refused at start-up (`tracing_unavailable`).
"""

from __future__ import annotations

import contextvars
import os
import threading
from typing import Any, Protocol

from shuttle.common.messages import Submit

# The W3C trace-context headers of the HTTP request being handled (set by `trace_context_middleware`), read when the
# request's sequences are created, so each span joins the caller's trace.
TRACE_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("shuttle_trace_headers",
                                                                                       default=None)
TRACE_HEADER_NAMES = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
GENERAL_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
FLUSH_AT_EXIT_MS = 2000  # how long the frontend's exit waits for the collector to take the last spans


def tracing_unavailable() -> str | None:
    """Why --otlp-traces-endpoint cannot be served here (the SDK or an exporter is not installed, or the protocol
    is not one shuttle exports with), else None."""
    protocol = otlp_protocol()
    if protocol not in PROTOCOLS:
        which = PROTOCOL_ENV if os.environ.get(PROTOCOL_ENV) else GENERAL_PROTOCOL_ENV
        return f"${which} {protocol!r} is not one of {', '.join(PROTOCOLS)}"
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporters (pip install 'shuttle[otel]'): " \
               f"{exc}"
    return None


class TracedSequence(Protocol):
    """What a span is made of: metrics.py's RequestMetrics (times are time.time() seconds; 0.0: not reached)."""

    request: Submit | None
    trace_headers: dict[str, str] | None
    group: int | None
    prompt: Any  # its PromptMetrics (`n`), None for a lone sequence
    arrival: float
    first_scheduled: float
    first_token: float
    last_token: float
    num_prompt_tokens: int
    num_tokens: int


class RequestTracer:
    """Ends each sequence's span (RequestMetrics.on_finish calls `finish`).

    Args:
        endpoint: the OTLP collector (gRPC: host:port or http://host:port; http/protobuf: its base URL or the full
            /v1/traces URL). Ignored when `processor` is given.
        model_name: the served model's name (gen_ai.response.model of a request that named no LoRA adapter).
        processor: a span processor to use instead of the OTLP batch exporter (tests: the SDK's in-memory exporter).

    Raises:
        ValueError: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names a protocol other than grpc or http/protobuf.
    """

    def __init__(self, endpoint: str, model_name: str, processor: Any = None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        service = os.environ.get("OTEL_SERVICE_NAME") or "shuttle"
        # no exit hook of the SDK's own: its shutdown would wait out a silent collector's export timeout (10 s and
        # more); the frontend flushes for at most FLUSH_AT_EXIT_MS instead (flush)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
        self.provider.add_span_processor(processor if processor is not None else
                                         BatchSpanProcessor(_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("shuttle")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = SpanKind.SERVER
        self.model_name = model_name

    def finish(self, sequence: TracedSequence, finish_reason: str) -> None:
        """Record the span of `sequence`, which ended now with `finish_reason`."""
        from opentelemetry.trace import Status, StatusCode

        request = sequence.request
        parent = self.propagator.extract(sequence.trace_headers) if sequence.trace_headers else None
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self.kind,
                                      start_time=int(sequence.arrival * 1e9))
        attributes: dict[str, Any] = {
            "gen_ai.response.model": (request.lora_name if request is not None and request.lora_name else
                                      self.model_name),
            "gen_ai.usage.prompt_tokens": sequence.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": sequence.num_tokens,
            "gen_ai.request.n": sequence.prompt.n if sequence.prompt is not None else 1,
            "gen_ai.response.finish_reasons": [finish_reason],
        }
        if request is not None:
            attributes.update({"gen_ai.request.id": request.request_id,
                               "gen_ai.request.max_tokens": request.sampling.max_tokens,
                               "gen_ai.request.temperature": request.sampling.temperature,
                               "gen_ai.request.top_p": request.sampling.top_p})
        if sequence.group is not None:
            attributes["shuttle.group"] = sequence.group
        if sequence.first_scheduled:
            attributes["gen_ai.latency.time_in_queue"] = max(sequence.first_scheduled - sequence.arrival, 0.0)
        if sequence.first_token:
            attributes["gen_ai.latency.time_to_first_token"] = sequence.first_token - sequence.arrival
            attributes["gen_ai.latency.e2e"] = sequence.last_token - sequence.arrival
            attributes["gen_ai.latency.time_in_model_decode"] = sequence.last_token - sequence.first_token
            if sequence.first_scheduled:
                attributes["gen_ai.latency.time_in_model_prefill"] = max(
                    sequence.first_token - sequence.first_scheduled, 0.0)
                attributes["gen_ai.latency.time_in_model_inference"] = max(
                    sequence.last_token - sequence.first_scheduled, 0.0)
        span.set_attributes(attributes)
        if finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def flush(self) -> None:
        """Export what is still buffered, for at most FLUSH_AT_EXIT_MS (at the frontend's exit: an unreachable
        collector must not hold the drain)."""
        # in a thread of its own: the SDK's flush waits out an export in progress whatever its timeout says (10 s
        # against a collector that accepts and never answers); a daemon thread does not hold the exit
        flushing = threading.Thread(target=self.provider.force_flush, args=(FLUSH_AT_EXIT_MS,), name="span-flush",
                                    daemon=True)
        flushing.start()
        flushing.join(FLUSH_AT_EXIT_MS / 1000)


def otlp_protocol() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else the general OTEL_EXPORTER_OTLP_PROTOCOL (the SDK's rule), else grpc
    (vLLM's default)."""
    return os.environ.get(PROTOCOL_ENV) or os.environ.get(GENERAL_PROTOCOL_ENV) or "grpc"


def _exporter(endpoint: str):
    """The OTLP span exporter for `endpoint`, by otlp_protocol()."""
    protocol = otlp_protocol()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=url)
    raise ValueError(f"${PROTOCOL_ENV} {protocol!r} is not one of grpc, http/protobuf")


def trace_context_middleware():
    """aiohttp middleware: the request's traceparent/tracestate headers, for the spans of its sequences."""
    from aiohttp import web

    @web.middleware
    async def trace_context(request: web.Request, handler):
        headers = {name: request.headers[name] for name in TRACE_HEADER_NAMES if name in request.headers}
        token = TRACE_HEADERS.set(headers or None)
        try:
            return await handler(request)
        finally:
            TRACE_HEADERS.reset(token)

    return trace_context
