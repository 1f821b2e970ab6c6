"""Collector (kvlens gateway): its own Prometheus metrics and one OpenTelemetry span per proxied request.

Metrics (``GET /metrics`` on the gateway's own port; every name ends in its unit):

- ``kvlens_gateway_requests_total{replica,code}``: answers relayed, by the replica's status code;
- ``kvlens_gateway_errors_total{replica,kind}``: ``status`` (the replica answered >= 400, passed
  through), ``unreachable`` (no answer: the gateway answers 502), ``tokenize`` (its /tokenize
  failed: forwarded, and recorded only through the replica's local ``tokenizer``), ``client_gone``
  (the client left mid-answer);
- ``kvlens_gateway_tokenize_seconds``: the replica's ``POST /tokenize`` round trip;
- ``kvlens_gateway_tokenize_local_total{replica}``: prompts encoded with the replica's configured
  ``tokenizer`` because its /tokenize failed;
- ``kvlens_gateway_rows_written_total{table}``: rows committed to the lake;
- ``kvlens_gateway_queue_depth_requests``: recorded requests not yet committed;
- ``kvlens_gateway_in_flight_requests{replica}``, ``kvlens_gateway_routed_total{replica,reason}``,
  ``kvlens_gateway_unrecorded_total{reason}``, ``kvlens_gateway_write_errors_total``.

Spans follow the OpenTelemetry GenAI semantic conventions (collector/otlp_genai.py holds the
names kvlens reads back): ``{operation} {model}`` with ``gen_ai.operation.name`` (``chat`` or
``text_completion``), ``gen_ai.request.model``, ``gen_ai.response.id``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``, ``gen_ai.usage.cache_read.input_tokens``,
``gen_ai.server.time_to_first_token`` (seconds, measured at the gateway), ``server.address`` /
``server.port`` (the replica), plus ``kvlens.replica`` and ``kvlens.routing.reason``. They are
exported with the SDK's batch processor over OTLP/HTTP (protobuf) to ``--otlp-endpoint``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvlens.collector.otlp_genai import CACHE_READ_KEYS, OPERATION

__all__ = ["GatewayMetrics", "Tracing", "traces_url"]

ROUTING_REASON = "kvlens.routing.reason"
REPLICA = "kvlens.replica"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvlens_gateway_requests", "Answers relayed, by replica and status code",
                                ["replica", "code"], registry=r)
        self.errors = Counter("kvlens_gateway_errors", "Failures by replica and kind", ["replica", "kind"],
                              registry=r)
        self.tokenize = Histogram("kvlens_gateway_tokenize_seconds", "POST /tokenize round trip", registry=r,
                                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
        self.tokenize_local = Counter("kvlens_gateway_tokenize_local",
                                      "Prompts encoded with the replica's local tokenizer.json", ["replica"],
                                      registry=r)
        self.rows_written = Counter("kvlens_gateway_rows_written", "Rows committed to the lake", ["table"],
                                    registry=r)
        self.queue_depth = Gauge("kvlens_gateway_queue_depth_requests",
                                 "Recorded requests not yet committed to the lake", registry=r)
        self.in_flight = Gauge("kvlens_gateway_in_flight_requests", "Requests forwarded and not done",
                               ["replica"], registry=r)
        self.routed = Counter("kvlens_gateway_routed", "Routing decisions by replica and reason",
                              ["replica", "reason"], registry=r)
        self.unrecorded = Counter("kvlens_gateway_unrecorded", "Forwarded, not recorded, by reason",
                                  ["reason"], registry=r)
        self.write_errors = Counter("kvlens_gateway_write_errors", "Lake writes that failed (retried)",
                                    registry=r)

    def value(self, name: str, **labels: str) -> float:
        got = self.registry.get_sample_value(name, labels)
        return 0.0 if got is None else got


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint as the exporter needs it: a bare ``http://host:port`` gets ``/v1/traces``."""
    from urllib.parse import urlsplit

    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class Tracing:
    """One span per proxied request to an OTLP/HTTP collector; a no-op without an endpoint."""

    def __init__(self, endpoint: str | None) -> None:
        self._provider: Any = None
        self._tracer: Any = None
        if not endpoint:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._provider = TracerProvider(resource=Resource.create({"service.name": "kvlens-gateway"}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self._tracer = self._provider.get_tracer("kvlens.gateway")

    def span(self, *, operation: str, model: str | None, start_ns: int, end_ns: int,
             attributes: dict[str, Any]) -> None:
        if self._tracer is None:
            return
        attrs = {OPERATION: operation, **{k: v for k, v in attributes.items() if v is not None}}
        if model:
            attrs["gen_ai.request.model"] = model
        span = self._tracer.start_span(f"{operation} {model or ''}".strip(), start_time=start_ns,
                                       attributes=attrs)
        span.end(end_time=end_ns)

    def close(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # flushes the batch processor


CACHE_READ = CACHE_READ_KEYS[0]
