"""Collector for engine traces: OTLP trace bodies (protobuf or JSON) -> ``requests`` rows.

vLLM (``--otlp-traces-endpoint``) emits one ``llm_request`` span per finished request
(FORMATS.md section 4). Each such span becomes one ``requests`` row, ``source = "otlp"``:

- ``request_id``: ``gen_ai.request.id`` as sent, never rewritten. vLLM names a completions
  call's engine requests ``<response id>-<prompt index>``; analyzers/join.py matches that form
  to the API's and the gateway's ids at join time.
- ``arrival_ns`` = span start (vLLM starts the span at the request's arrival), ``end_ns`` =
  span end; ``first_token_ns`` = arrival + ``gen_ai.latency.time_to_first_token``.
- ``ttft_ms``, ``queue_ms``, ``prefill_ms`` from ``gen_ai.latency.time_to_first_token``,
  ``…time_in_queue``, ``…time_in_model_prefill`` (seconds on the span, milliseconds here).
- ``prompt_tokens`` / ``output_tokens`` from ``gen_ai.usage.prompt_tokens`` /
  ``…completion_tokens``; ``model`` from ``gen_ai.response.model``, else
  ``gen_ai.request.model``, else the configured model (vLLM sets neither).
- ``replica``: the configured name, else the resource's ``service.instance.id``, else
  ``host.name``, else ``service.name``.

Other spans (vLLM's load-time spans, anything else a pipeline forwards) are counted in
``SpanBatch.other_spans``, never an error. OTLP JSON follows the OTLP/HTTP JSON mapping:
camelCase keys (snake_case also accepted), 64-bit integers as strings or numbers, ids as hex.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from google.protobuf.message import DecodeError as _PbDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvlens.errors import InputError
from kvlens.lake import SegmentWriter

__all__ = [
    "LLM_REQUEST_SPAN",
    "OtlpDecodeError",
    "OtlpImportResult",
    "SpanBatch",
    "import_otlp",
    "parse_otlp_json",
    "parse_otlp_protobuf",
]

log = logging.getLogger(__name__)

LLM_REQUEST_SPAN = "llm_request"
_ID = "gen_ai.request.id"
_TTFT = "gen_ai.latency.time_to_first_token"
_QUEUE = "gen_ai.latency.time_in_queue"
_PREFILL = "gen_ai.latency.time_in_model_prefill"
_PROMPT = "gen_ai.usage.prompt_tokens"
_COMPLETION = "gen_ai.usage.completion_tokens"
_RESPONSE_MODEL = "gen_ai.response.model"
_REQUEST_MODEL = "gen_ai.request.model"
_WANTED = frozenset({_ID, _TTFT, _QUEUE, _PREFILL, _PROMPT, _COMPLETION, _RESPONSE_MODEL, _REQUEST_MODEL})
_REPLICA_KEYS = ("service.instance.id", "host.name", "service.name")
_INT32_MAX = 2**31 - 1


class OtlpDecodeError(ValueError):
    """A body that is not an ExportTraceServiceRequest (protobuf or OTLP JSON)."""


@dataclass
class SpanBatch:
    """What one OTLP body held: ``requests`` rows, and counts of what was not turned into rows."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    other_spans: int = 0
    bad_spans: int = 0  # llm_request spans without a request id or with a value of the wrong type

    @property
    def spans(self) -> int:
        return len(self.rows) + self.other_spans + self.bad_spans


# -- from span fields to a row --------------------------------------------------------------


def _replica(resource: Mapping[str, Any], configured: str | None) -> str | None:
    if configured:
        return configured
    for key in _REPLICA_KEYS:
        value = resource.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _seconds_ms(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) * 1000.0


def _tokens(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
        return None
    return value


def _request_row(attrs: Mapping[str, Any], start_ns: int, end_ns: int, replica: str | None,
                 model: str | None) -> dict[str, Any] | None:
    rid = attrs.get(_ID)
    if not isinstance(rid, str) or not rid:
        return None
    ttft_ms = _seconds_ms(attrs.get(_TTFT))
    span_model = attrs.get(_RESPONSE_MODEL) or attrs.get(_REQUEST_MODEL)
    return {
        "request_id": rid,
        "arrival_ns": start_ns or None,
        "first_token_ns": start_ns + round(ttft_ms * 1e6) if start_ns and ttft_ms is not None else None,
        "end_ns": end_ns or None,
        "replica": replica,
        "model": span_model if isinstance(span_model, str) and span_model else model,
        "prompt_tokens": _tokens(attrs.get(_PROMPT)),
        "output_tokens": _tokens(attrs.get(_COMPLETION)),
        "ttft_ms": ttft_ms,
        "queue_ms": _seconds_ms(attrs.get(_QUEUE)),
        "prefill_ms": _seconds_ms(attrs.get(_PREFILL)),
        "source": "otlp",
    }


def _add_span(out: SpanBatch, name: str, attrs: Mapping[str, Any], start_ns: int, end_ns: int,
              replica: str | None, model: str | None) -> None:
    if name != LLM_REQUEST_SPAN:
        out.other_spans += 1
        return
    row = _request_row(attrs, start_ns, end_ns, replica, model)
    if row is None:
        out.bad_spans += 1
    else:
        out.rows.append(row)


# -- protobuf -------------------------------------------------------------------------------


def _pb_attrs(attributes: Iterable[Any], wanted: frozenset[str]) -> dict[str, Any]:
    # The hot loop of the receiver: inlined, and only the attributes a row needs.
    out: dict[str, Any] = {}
    for a in attributes:
        key = a.key
        if key in wanted:
            v = a.value
            kind = v.WhichOneof("value")
            out[key] = None if kind is None else getattr(v, kind)
    return out


def parse_otlp_protobuf(body: bytes, *, replica: str | None = None, model: str | None = None) -> SpanBatch:
    """Rows from a protobuf ``ExportTraceServiceRequest``; OtlpDecodeError when it is not one."""
    msg = ExportTraceServiceRequest()
    try:
        msg.ParseFromString(body)
    except (_PbDecodeError, RuntimeError, ValueError) as e:
        raise OtlpDecodeError(f"not a protobuf ExportTraceServiceRequest: {e}") from None
    out = SpanBatch()
    for rs in msg.resource_spans:
        rep = _replica(_pb_attrs(rs.resource.attributes, frozenset(_REPLICA_KEYS)), replica)
        for ss in rs.scope_spans:
            for span in ss.spans:
                if span.name != LLM_REQUEST_SPAN:
                    out.other_spans += 1
                    continue
                _add_span(out, span.name, _pb_attrs(span.attributes, _WANTED), span.start_time_unix_nano,
                          span.end_time_unix_nano, rep, model)
    return out


# -- OTLP JSON ------------------------------------------------------------------------------


def _get(obj: Any, camel: str, snake: str) -> Any:
    if not isinstance(obj, dict):
        return None
    value = obj.get(camel)
    return obj.get(snake) if value is None else value


def _list(obj: Any, camel: str, snake: str) -> list[Any]:
    value = _get(obj, camel, snake)
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpDecodeError(f"{camel} is not a list")
    return value


def _json_int(value: Any) -> int | None:
    """An OTLP JSON 64-bit integer: a JSON number or a decimal string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _json_value(v: Any) -> Any:
    if not isinstance(v, dict):
        return None
    for camel, snake in (("stringValue", "string_value"), ("boolValue", "bool_value")):
        if (x := _get(v, camel, snake)) is not None:
            return x
    if (x := _get(v, "intValue", "int_value")) is not None:
        return _json_int(x)
    if (x := _get(v, "doubleValue", "double_value")) is not None:
        # The JSON mapping writes non-finite doubles as strings ("NaN", "Infinity").
        return float(x) if isinstance(x, str) and x in ("NaN", "Infinity", "-Infinity") else x
    return None


def _json_attrs(attributes: list[Any]) -> dict[str, Any]:
    return {a["key"]: _json_value(a.get("value")) for a in attributes
            if isinstance(a, dict) and isinstance(a.get("key"), str)}


def parse_otlp_json(data: bytes | Any, *, replica: str | None = None, model: str | None = None) -> SpanBatch:
    """Rows from an OTLP JSON ``ExportTraceServiceRequest`` (bytes, or an already decoded dict)."""
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            data = msgspec.json.decode(data)
        except msgspec.DecodeError as e:
            raise OtlpDecodeError(f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise OtlpDecodeError(f"expected a JSON object (ExportTraceServiceRequest), "
                              f"got {type(data).__name__}")
    out = SpanBatch()
    for rs in _list(data, "resourceSpans", "resource_spans"):
        resource = _get(rs, "resource", "resource") or {}
        rep = _replica(_json_attrs(_list(resource, "attributes", "attributes")), replica)
        for ss in _list(rs, "scopeSpans", "scope_spans"):
            for span in _list(ss, "spans", "spans"):
                if not isinstance(span, dict):
                    raise OtlpDecodeError("a span is not a JSON object")
                start = _json_int(_get(span, "startTimeUnixNano", "start_time_unix_nano")) or 0
                end = _json_int(_get(span, "endTimeUnixNano", "end_time_unix_nano")) or 0
                attrs = _json_attrs(_list(span, "attributes", "attributes"))
                _add_span(out, str(span.get("name", "")), attrs, start, end, rep, model)
    return out


# -- file import ----------------------------------------------------------------------------


@dataclass
class OtlpImportResult:
    format: str
    scenario: str
    files: list[str]
    requests: int = 0
    other_spans: int = 0
    bad_spans: int = 0
    bad_lines: int = 0
    first_bad: list[str] = field(default_factory=list)


def _json_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    from collector.importer import _checked_lines  # the importer's gzip-aware, error-naming reader

    for lineno, line, _pos in _checked_lines(path):
        if line:
            yield lineno, line


def _file_batches(fmt: str, path: Path, replica: str | None, model: str | None,
                  result: OtlpImportResult, skip_bad_lines: bool) -> Iterator[SpanBatch]:
    if fmt == "otlp":  # one raw protobuf body per file, as an exporter posts it
        try:
            yield parse_otlp_protobuf(path.read_bytes(), replica=replica, model=model)
        except OtlpDecodeError as e:
            raise InputError(f"{e}; give a protobuf ExportTraceServiceRequest body", path=str(path)) from None
        return
    for lineno, line in _json_lines(path):
        try:
            yield parse_otlp_json(line, replica=replica, model=model)
        except OtlpDecodeError as e:
            if not skip_bad_lines:
                raise InputError(f"{e}; fix the line or pass --skip-bad-lines",
                                 path=str(path), line=lineno) from None
            result.bad_lines += 1
            if len(result.first_bad) < 5:
                result.first_bad.append(f"{path}:{lineno}: {e}")
            log.warning("skipped bad line %s:%d: %s", path, lineno, e)


def import_otlp(fmt: str, paths: Sequence[str | os.PathLike[str]], lake: str | os.PathLike[str], *,
                scenario: str = "default", replica: str | None = None, model: str | None = None,
                skip_bad_lines: bool = False) -> OtlpImportResult:
    """Import OTLP trace files into ``requests`` of ``scenario``, replacing it (all or nothing).

    ``fmt`` is ``otlp-json`` (the OpenTelemetry Collector file exporter: one
    ExportTraceServiceRequest JSON per line, plain or .gz) or ``otlp`` (each file one
    protobuf body).
    """
    if fmt not in ("otlp-json", "otlp"):
        raise ValueError(f"unknown OTLP format {fmt!r}")
    files = [Path(p) for p in paths]
    for p in files:
        if not p.is_file():
            raise InputError("no such file: check the path", path=str(p))
    result = OtlpImportResult(fmt, scenario, [str(p) for p in files])
    with SegmentWriter(lake, "requests", scenario=scenario, writer_id=f"import-{fmt}", replace=True) as w:
        for path in files:
            for batch in _file_batches(fmt, path, replica, model, result, skip_bad_lines):
                w.append_rows(batch.rows)
                result.requests += len(batch.rows)
                result.other_spans += batch.other_spans
                result.bad_spans += batch.bad_spans
    log.info("imported %d requests into scenario %s (%d other spans, %d bad spans, %d bad lines)",
             result.requests, scenario, result.other_spans, result.bad_spans, result.bad_lines)
    return result
