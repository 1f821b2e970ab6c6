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

Spans of other instrumented clients and routers that follow the OpenTelemetry GenAI semantic
conventions (``gen_ai.operation.name`` a generation operation) are requests too, read with the
convention's names where vLLM's are absent (collector/otlp_genai.py): ``gen_ai.response.id``,
``gen_ai.usage.input_tokens`` / ``output_tokens``, ``gen_ai.usage.cache_read.input_tokens`` (the row's
``cached_tokens``), ``gen_ai.server.time_to_first_token``; their replica is the configured name,
else the span's ``server.address[:server.port]``, else the resource's.

Other spans (vLLM's load-time spans, anything else a pipeline forwards) are counted in
``SpanBatch.other_spans``, never an error.

An ``llm_request`` span whose values its row cannot hold is a **bad span** (counted in
``SpanBatch.bad_spans``, its reason kept in ``bad_reasons``), never a row: no request id; a
start or end past int64 nanoseconds (the proto's times are uint64); a latency that is
negative, or a first token past int64 nanoseconds (a TTFT of 1e10 s); a token count that is
not an integer in [0, 2**31). A latency that is NaN or infinite is unknown (NULL), as the
OTLP JSON mapping writes an unset double. Nesting deeper than the decoder's recursion limit
is an OtlpDecodeError. OTLP JSON follows the OTLP/HTTP JSON mapping:
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

from kvlens.collector.fields import checked_lines
from kvlens.collector.otlp_genai import (
    CACHE_READ_KEYS,
    COMPLETION_KEYS,
    ID_KEYS,
    PROMPT_KEYS,
    SEMCONV_KEYS,
    TTFT_KEYS,
    first_present,
    is_request_span,
    server_replica,
)
from kvlens.errors import InputError
from kvlens.lake import SegmentWriter
from kvlens.limits import INT32_MAX, INT64_MAX

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
_WANTED = frozenset({_ID, _TTFT, _QUEUE, _PREFILL, _PROMPT, _COMPLETION, _RESPONSE_MODEL, _REQUEST_MODEL,
                     *SEMCONV_KEYS})
_REPLICA_KEYS = ("service.instance.id", "host.name", "service.name")
_MAX_BAD_REASONS = 5
_MAX_SECONDS = 1e10  # 317 years: past it a latency is not one (and its nanoseconds pass 2**63)


class OtlpDecodeError(ValueError):
    """A body that is not an ExportTraceServiceRequest (protobuf or OTLP JSON)."""


@dataclass
class SpanBatch:
    """What one OTLP body held: ``requests`` rows, and counts of what was not turned into rows."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    other_spans: int = 0
    bad_spans: int = 0  # llm_request spans without a request id or with a value their row cannot hold
    bad_reasons: list[str] = field(default_factory=list)  # the first few, for the log

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


class _BadSpan(ValueError):
    """An llm_request span that cannot be a row; the message says which value and why."""


def _seconds_ms(attrs: Mapping[str, Any], key: str) -> float | None:
    value = attrs.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadSpan(f"{key} is a {type(value).__name__}, expected seconds")
    if not math.isfinite(value):
        return None  # the JSON mapping's "NaN": unknown
    if not 0 <= value <= _MAX_SECONDS:
        raise _BadSpan(f"{key} = {value!r} s is not a latency")
    return float(value) * 1000.0


def _tokens(attrs: Mapping[str, Any], key: str) -> int | None:
    value = attrs.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
        raise _BadSpan(f"{key} = {value!r:.40} is not a token count in [0, 2**31)")
    return value


def _time_ns(value: int, what: str) -> int | None:
    if not 0 <= value <= INT64_MAX:
        raise _BadSpan(f"{what} {value} is outside int64 nanoseconds since the epoch")
    return value or None


def _request_row(attrs: Mapping[str, Any], start_ns: int, end_ns: int, replica: str | None,
                 model: str | None) -> dict[str, Any]:
    rid = attrs.get(first_present(attrs, ID_KEYS))
    if not isinstance(rid, str) or not rid:
        raise _BadSpan(f"no {_ID} (nor {ID_KEYS[1]})")
    arrival, end = _time_ns(start_ns, "start"), _time_ns(end_ns, "end")
    ttft_ms = _seconds_ms(attrs, first_present(attrs, TTFT_KEYS))
    first = None
    if arrival and ttft_ms is not None:
        first = arrival + round(ttft_ms * 1e6)  # below 2**63 + 1e19: _MAX_SECONDS bounds the TTFT
        if first > INT64_MAX:
            raise _BadSpan(f"first token {ttft_ms / 1000:g} s after the start is past int64 nanoseconds")
    span_model = attrs.get(_RESPONSE_MODEL) or attrs.get(_REQUEST_MODEL)
    return {
        "request_id": rid,
        "arrival_ns": arrival,
        "first_token_ns": first,
        "end_ns": end,
        "replica": replica,
        "model": span_model if isinstance(span_model, str) and span_model else model,
        "prompt_tokens": _tokens(attrs, first_present(attrs, PROMPT_KEYS)),
        "output_tokens": _tokens(attrs, first_present(attrs, COMPLETION_KEYS)),
        "cached_tokens": _tokens(attrs, first_present(attrs, CACHE_READ_KEYS)),
        "ttft_ms": ttft_ms,
        "queue_ms": _seconds_ms(attrs, _QUEUE),
        "prefill_ms": _seconds_ms(attrs, _PREFILL),
        "source": "otlp",
    }


def _add_span(out: SpanBatch, name: str, attrs: Mapping[str, Any], start_ns: int, end_ns: int,
              replica: str | None, model: str | None, configured: bool) -> None:
    if not is_request_span(name, attrs, LLM_REQUEST_SPAN):
        out.other_spans += 1
        return
    if name != LLM_REQUEST_SPAN and not configured:
        replica = server_replica(attrs) or replica
    try:
        out.rows.append(_request_row(attrs, start_ns, end_ns, replica, model))
    except _BadSpan as e:
        out.bad_spans += 1
        if len(out.bad_reasons) < _MAX_BAD_REASONS:
            out.bad_reasons.append(str(e))


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


def parse_otlp_protobuf(body: bytes | bytearray, *, replica: str | None = None,
                        model: str | None = None) -> SpanBatch:
    """Rows from a protobuf ``ExportTraceServiceRequest``; OtlpDecodeError when it is not one."""
    msg = ExportTraceServiceRequest()
    try:
        msg.ParseFromString(body)
    except (_PbDecodeError, RuntimeError, ValueError) as e:  # RecursionError is a RuntimeError
        raise OtlpDecodeError(f"not a protobuf ExportTraceServiceRequest: {e}") from None
    out = SpanBatch()
    for rs in msg.resource_spans:
        rep = _replica(_pb_attrs(rs.resource.attributes, frozenset(_REPLICA_KEYS)), replica)
        for ss in rs.scope_spans:
            for span in ss.spans:
                _add_span(out, span.name, _pb_attrs(span.attributes, _WANTED), span.start_time_unix_nano,
                          span.end_time_unix_nano, rep, model, bool(replica))
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
        except RecursionError:
            raise OtlpDecodeError("JSON nests deeper than the decoder's recursion limit") from None
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
                _add_span(out, str(span.get("name", "")), attrs, start, end, rep, model, bool(replica))
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
    for lineno, line, _pos in checked_lines(path):
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
