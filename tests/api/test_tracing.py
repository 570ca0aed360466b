"""Issue 46: OpenTelemetry tracing (--otlp-traces-endpoint). One `llm_request` span per sequence with vLLM's
attribute names, a child of the caller's W3C traceparent; exported over OTLP gRPC (the default protocol) and
http/protobuf to local receivers; an unknown protocol refused at start-up."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from shuttle.common.messages import SamplingParams, Submit
from shuttle.frontend.observability.metrics import Metrics
from shuttle.frontend.observability.tracing import RequestTracer
from tests.api.test_api_details import PROMPT, STORY, served
from tests.fake_engine import FakeEngine
from tests.server import MODEL_DIR

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def in_memory_tracer() -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return RequestTracer("", "stories", processor=SimpleSpanProcessor(exporter)), exporter


async def test_one_span_per_sequence_with_vllms_attributes_in_the_callers_trace():
    tracer, exporter = in_memory_tracer()
    async with served(FakeEngine(script=list(STORY)), tracer=tracer) as (client, _):
        async with client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": 2, "temperature": 0.5,
                                                        "top_p": 0.9}, headers={"traceparent": TRACEPARENT}) as r:
            body = await r.json()
        async with client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}) as r:
            other = await r.json()
    spans = exporter.get_finished_spans()
    assert len(spans) == 3  # n=2, then one
    mine = sorted((s for s in spans if s.attributes["gen_ai.request.id"].startswith(body["id"])),
                  key=lambda s: s.attributes["gen_ai.request.id"])
    assert [s.attributes["gen_ai.request.id"] for s in mine] == [f"{body['id']}-0", f"{body['id']}-1"]
    for span in mine:
        a = span.attributes
        assert span.name == "llm_request" and span.kind == SpanKind.SERVER
        assert format(span.context.trace_id, "032x") == TRACE_ID  # the caller's trace
        assert format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
        assert a["gen_ai.response.model"] == "stories"
        assert a["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"]
        assert a["gen_ai.usage.completion_tokens"] == 5
        assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.n"]) == (5, 2)
        assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (0.5, pytest.approx(0.9))
        assert a["gen_ai.response.finish_reasons"] == ("length",)
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert span.end_time - span.start_time >= a["gen_ai.latency.e2e"] * 1e9 * 0.99
    (lone,) = [s for s in spans if s.attributes["gen_ai.request.id"] == other["id"] + "-0"]
    assert lone.parent is None and format(lone.context.trace_id, "032x") != TRACE_ID  # a trace of its own


async def test_a_failed_sequence_ends_its_span_with_an_error_status():
    tracer, exporter = in_memory_tracer()
    async with served(FakeEngine(error=(500, "the worker failed")), tracer=tracer) as (client, _):
        async with client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}) as r:
            assert r.status == 500
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)


def finished_sequence(tracer: RequestTracer) -> None:
    """One sequence's life, fabricated: submitted, two tokens, ended."""
    metrics = Metrics(lambda: None)
    metrics.tracer = tracer
    sequence = metrics.prompt(1).sequence(4)
    sequence.on_submit(Submit(request_id="cmpl-otlp-0", prompt_token_ids=[1, 2, 3, 4],
                              sampling=SamplingParams(max_tokens=2), arrival_time=time.time()))
    sequence.first_token = sequence.last_token = time.time()
    sequence.num_tokens = 2
    sequence.on_finish("length")


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def exported_spans(requests) -> list:
    return [span for request in requests for resource in request.resource_spans for scope in resource.scope_spans
            for span in scope.spans]


def test_spans_reach_an_otlp_grpc_collector(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "true")
    collector = TraceCollector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracer = RequestTracer(f"http://127.0.0.1:{port}", "stories")
        finished_sequence(tracer)
        tracer.flush()
    finally:
        server.stop(0)
    (span,) = exported_spans(collector.requests)
    attributes = {a.key: a.value for a in span.attributes}
    assert span.name == "llm_request"
    assert attributes["gen_ai.request.id"].string_value == "cmpl-otlp-0"
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 2
    assert attributes["gen_ai.usage.prompt_tokens"].int_value == 4


async def test_spans_reach_an_otlp_http_collector(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        tracer = RequestTracer(f"http://127.0.0.1:{port}", "stories")
        finished_sequence(tracer)
        await asyncio.to_thread(tracer.flush)  # the exporter posts from its thread; this loop answers it
    finally:
        await runner.cleanup()
    (span,) = exported_spans(received)
    assert span.name == "llm_request"
    assert {a.key: a.value for a in span.attributes}["gen_ai.request.id"].string_value == "cmpl-otlp-0"


def test_an_unknown_otlp_protocol_is_refused_at_start_up():
    done = subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "serve", str(MODEL_DIR), "--port", "0",
                           "--otlp-traces-endpoint", "http://127.0.0.1:4317"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert done.returncode == 2
    assert done.stderr.strip() == "shuttle: error: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL 'http/json' is not one of " \
                                  "grpc, http/protobuf", done.stderr


def test_a_collector_that_never_answers_holds_the_exit_at_most_the_flush_bound(monkeypatch):
    """At exit the frontend waits FLUSH_AT_EXIT_MS for the last spans, also when the collector accepts connections and
    never answers (the SDK's own flush would wait out its 10 s export timeout)."""
    import socket

    from shuttle.frontend.observability.tracing import FLUSH_AT_EXIT_MS
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; nothing is ever read or answered
        tracer = RequestTracer(f"http://127.0.0.1:{silent.getsockname()[1]}", "stories")
        finished_sequence(tracer)
        began = time.monotonic()
        tracer.flush()
        assert time.monotonic() - began < FLUSH_AT_EXIT_MS / 1000 + 0.5


def test_the_general_otlp_protocol_variable_is_the_fallback(monkeypatch):
    from shuttle.frontend.observability.tracing import otlp_protocol, tracing_unavailable
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert otlp_protocol() == "http/protobuf" and tracing_unavailable() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "bogus")
    assert tracing_unavailable() == "$OTEL_EXPORTER_OTLP_PROTOCOL 'bogus' is not one of grpc, http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # the traces-specific one wins
    assert otlp_protocol() == "grpc"
