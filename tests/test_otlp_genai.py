"""OTLP spans named as the OpenTelemetry GenAI semantic conventions name them become requests rows.

The spans are made by the OpenTelemetry SDK and encoded by its own OTLP protobuf encoder (the bytes
an instrumented client or router posts), then decoded by collector.otlp.
"""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_otlp import otlp_json

from collector.otlp import SpanBatch, parse_otlp_json, parse_otlp_protobuf

T0_NS = 1_735_689_600 * 10**9
CHAT = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "llama-3.1-8b",
        "gen_ai.response.id": "chatcmpl-42", "gen_ai.usage.input_tokens": 1200,
        "gen_ai.usage.output_tokens": 30, "gen_ai.usage.cache_read.input_tokens": 1024,
        "gen_ai.server.time_to_first_token": 0.25, "server.address": "vllm-3.internal", "server.port": 8000}


def _body(spans: list[tuple[str, dict[str, Any]]]) -> bytes:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.instance.id": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("a.genai.client")
    for i, (name, attrs) in enumerate(spans):
        start = T0_NS + i * 10**9
        tracer.start_span(name, start_time=start, attributes=attrs).end(end_time=start + 500_000_000)
    provider.shutdown()
    return bytes(encode_spans(memory.get_finished_spans()).SerializeToString())


def test_a_convention_chat_span_is_a_request_row() -> None:
    batch = parse_otlp_protobuf(_body([("chat llama-3.1-8b", CHAT)]))
    assert batch.other_spans == 0 and batch.bad_spans == 0
    (row,) = batch.rows
    assert row["request_id"] == "chatcmpl-42"
    assert (row["prompt_tokens"], row["output_tokens"], row["cached_tokens"]) == (1200, 30, 1024)
    assert row["ttft_ms"] == pytest.approx(250.0)
    assert row["first_token_ns"] == T0_NS + 250_000_000
    assert row["replica"] == "vllm-3.internal:8000"  # the server the client called, not the router
    assert row["model"] == "llama-3.1-8b" and row["source"] == "otlp"


def test_json_and_protobuf_agree_and_the_configured_replica_wins() -> None:
    body = _body([("chat llama-3.1-8b", CHAT)])
    assert parse_otlp_json(otlp_json(body)).rows == parse_otlp_protobuf(body).rows
    assert parse_otlp_protobuf(body, replica="replica-9").rows[0]["replica"] == "replica-9"


def test_vllm_names_win_where_both_are_present() -> None:
    both = {**CHAT, "gen_ai.request.id": "cmpl-7-0", "gen_ai.usage.prompt_tokens": 1300,
            "gen_ai.latency.time_to_first_token": 0.5}
    (row,) = parse_otlp_protobuf(_body([("llm_request", both)])).rows
    assert (row["request_id"], row["prompt_tokens"]) == ("cmpl-7-0", 1300)
    assert row["ttft_ms"] == pytest.approx(500.0)
    assert row["replica"] == "router"  # vLLM's own span: its resource names the replica


def test_other_operations_are_not_requests_and_idless_chats_are_bad() -> None:
    batch: SpanBatch = parse_otlp_protobuf(_body([
        ("embeddings e5", {"gen_ai.operation.name": "embeddings", "gen_ai.response.id": "e1"}),
        ("execute_tool search", {"gen_ai.operation.name": "execute_tool"}),
        ("chat llama", {k: v for k, v in CHAT.items() if k != "gen_ai.response.id"}),
        ("GET /health", {}),
    ]))
    assert (len(batch.rows), batch.other_spans, batch.bad_spans) == (0, 3, 1)
    assert "gen_ai.response.id" in batch.bad_reasons[0]
