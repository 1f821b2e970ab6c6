"""Collector: OpenTelemetry GenAI semantic-convention names, beside vLLM's own, for OTLP spans.

vLLM's ``llm_request`` span (vllm/tracing.py ``SpanAttributes``) uses its own names
(``gen_ai.usage.prompt_tokens``, ``gen_ai.latency.time_to_first_token``, ``gen_ai.request.id``).
Other instrumented clients and routers follow the OpenTelemetry GenAI semantic conventions
(https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/): a span per inference call,
named ``{gen_ai.operation.name} {gen_ai.request.model}``, with

- ``gen_ai.response.id`` (the request id when ``gen_ai.request.id`` is absent),
- ``gen_ai.usage.input_tokens`` / ``gen_ai.usage.output_tokens`` (prompt / output tokens),
- ``gen_ai.usage.cache_read.input_tokens``: input tokens served from the provider's cache
  (the requests row's ``cached_tokens``),
- the convention's latencies, defined as metrics ``gen_ai.server.time_to_first_token`` and
  ``gen_ai.server.time_per_output_token`` (seconds), read when a span carries them as attributes,
- ``server.address`` / ``server.port``: the server (replica) the client called.

A span is a request when its name is vLLM's ``llm_request`` or its ``gen_ai.operation.name`` is
one of the convention's generation operations (``GENERATION_OPERATIONS``); embeddings, tool and
agent spans are not requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CACHE_READ_KEYS", "COMPLETION_KEYS", "GENERATION_OPERATIONS", "ID_KEYS", "OPERATION",
           "PROMPT_KEYS", "SEMCONV_KEYS", "SERVER_ADDRESS", "SERVER_PORT", "TTFT_KEYS", "first_present",
           "is_request_span", "server_replica"]

OPERATION = "gen_ai.operation.name"
GENERATION_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
ID_KEYS = ("gen_ai.request.id", "gen_ai.response.id")  # vLLM's first, then the convention's
PROMPT_KEYS = ("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens")
COMPLETION_KEYS = ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens")
CACHE_READ_KEYS = ("gen_ai.usage.cache_read.input_tokens",)
TTFT_KEYS = ("gen_ai.latency.time_to_first_token", "gen_ai.server.time_to_first_token")
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
SEMCONV_KEYS = frozenset({OPERATION, *ID_KEYS, *PROMPT_KEYS, *COMPLETION_KEYS, *CACHE_READ_KEYS, *TTFT_KEYS,
                          SERVER_ADDRESS, SERVER_PORT})


def is_request_span(name: str, attrs: Mapping[str, Any], vllm_name: str) -> bool:
    """vLLM's request span, or a convention span of a generation operation."""
    return name == vllm_name or attrs.get(OPERATION) in GENERATION_OPERATIONS


def first_present(attrs: Mapping[str, Any], keys: Sequence[str]) -> str:
    """The first of ``keys`` the span carries (the last key when none: its absence reads as None)."""
    for key in keys:
        if attrs.get(key) is not None:
            return key
    return keys[-1]


def server_replica(attrs: Mapping[str, Any]) -> str | None:
    """``host:port`` (or ``host``) of the server a convention client span called."""
    host = attrs.get(SERVER_ADDRESS)
    if not isinstance(host, str) or not host:
        return None
    port = attrs.get(SERVER_PORT)
    return f"{host}:{port}" if isinstance(port, int) and not isinstance(port, bool) else host
