"""Fuzz targets: one function per decoder, taking bytes, raising only the decoder's own errors.

Each target decodes one input the way its collector does and checks every row it yields against
the schema's limits (kvlens.limits): a row that does not fit is a ``PoisonRow``. An exception
that is neither the decoder's error (``ALLOWED``) nor a PoisonRow is a finding.

Seeds are real: the vLLM CPU capture's frames and OTLP bodies (one span per seed, cut from the
real bodies), its /metrics exposition (cut per metric family), the shipped Mooncake trace and
the README's gateway and LMCache examples.
"""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvlens.collector import importer
from kvlens.collector.otlp import OtlpDecodeError, parse_otlp_json, parse_otlp_protobuf
from kvlens.collector.scrape import ScrapeError, _columns, parse_exposition
from kvlens.collector.vllm_events import DecodeError, EventDecoder, KvColumns
from kvlens.errors import KvlensError
from kvlens.limits import row_problem
from kvlens.schema import KV_EVENTS, METRIC_SAMPLES, REQUEST_BLOCKS, REQUESTS

REPO = Path(__file__).resolve().parents[2]
CAPTURE = REPO / "tests" / "data" / "vllm-cpu-capture"

__all__ = ["ALLOWED", "SEEDS", "TARGETS", "PoisonRow"]


class PoisonRow(AssertionError):
    """A decoder yielded a row its table cannot hold."""


def _check(table: Any, rows: list[dict[str, Any]]) -> int:
    for row in rows:
        problem = row_problem(table, row)
        if problem:
            raise PoisonRow(problem)
    return len(rows)


def _pydict_rows(cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
    names = list(cols)
    return [dict(zip(names, values, strict=True)) for values in zip(*cols.values(), strict=True)]


# -- vLLM / SGLang events ------------------------------------------------------------------------

_DECODERS = {keep: EventDecoder(keep_tokens=keep, chain_capacity=4096) for keep in (False, True)}


def vllm_events(data: bytes) -> int:
    """One payload; the first byte's low bit picks keep_tokens (token ids are INTEGER[])."""
    keep = bool(data[:1] and data[0] & 1)
    cols = KvColumns(keep)
    _DECODERS[keep].decode(data[1:], cols, replica="r", seq=1, recv_ns=1)
    rows = cols.take()
    return _check(KV_EVENTS, _pydict_rows(rows))


# -- OTLP ----------------------------------------------------------------------------------------

def otlp_protobuf(data: bytes) -> int:
    return _check(REQUESTS, parse_otlp_protobuf(data).rows)


def otlp_json(data: bytes) -> int:
    return _check(REQUESTS, parse_otlp_json(data).rows)


# -- trace lines ---------------------------------------------------------------------------------

LINE_FORMATS = importer.FORMATS  # mooncake, bailian, gateway, lmcache-lookup
_PARSERS: dict[str, Any] = {}


def _parser(fmt: str) -> Any:
    # a fresh parser now and then, so per-import state (sessions, repeats) stays small
    if fmt not in _PARSERS or len(_PARSERS) > 1000:
        _PARSERS[fmt] = importer._formats()[fmt](model=None, t0_ns=importer.DEFAULT_T0_NS)
    return _PARSERS[fmt]


_JSON = msgspec.json.Decoder()


def trace_lines(data: bytes) -> int:
    """The first byte picks the format; the rest is one line, decoded as ``kvlens import`` does."""
    fmt = LINE_FORMATS[data[0] % len(LINE_FORMATS)] if data else LINE_FORMATS[0]
    parsed = importer.decode_line(_parser(fmt), _JSON, data[1:], lineno=7, stem="fuzz")
    if parsed is None:
        return 0
    _check(REQUESTS, [parsed.request])
    n = len(parsed.block_hashes)
    blocks = {"request_id": [parsed.request.get("request_id")] * n,
              "arrival_ns": [parsed.request.get("arrival_ns")] * n, "position": list(range(n)),
              "block_hash": list(parsed.block_hashes),
              "content_hash": (list(parsed.content_hashes) if parsed.content_hashes is not None
                               else [None] * n),
              "token_hash": list(parsed.token_hashes) if parsed.token_hashes is not None else [None] * n,
              "block_tokens": list(parsed.block_tokens), "block_size_tokens": [parsed.block_size_tokens] * n,
              "namespace": [parsed.namespace] * n}
    if len(parsed.block_tokens) != n:
        raise PoisonRow(f"{n} block hashes but {len(parsed.block_tokens)} block token counts")
    return 1 + _check(REQUEST_BLOCKS, _pydict_rows(blocks))


# -- Prometheus text -----------------------------------------------------------------------------

def prometheus(data: bytes) -> int:
    text = data.decode("utf-8", "replace")  # scrape.fetch refuses non-UTF-8 bodies before parsing
    samples = parse_exposition(text, prefixes=("",))  # every family, not only the allow-list
    return _check(METRIC_SAMPLES, _pydict_rows(_columns(samples, 1, "r")))


TARGETS: dict[str, Callable[[bytes], int]] = {
    "vllm_events": vllm_events, "otlp_protobuf": otlp_protobuf, "otlp_json": otlp_json,
    "trace_lines": trace_lines, "prometheus": prometheus,
}
# The error each decoder may raise (its own tree); anything else is a finding.
ALLOWED: dict[str, tuple[type[BaseException], ...]] = {
    "vllm_events": (DecodeError,), "otlp_protobuf": (OtlpDecodeError,), "otlp_json": (OtlpDecodeError,),
    "trace_lines": (importer.FieldError, KvlensError), "prometheus": (ScrapeError,),
}


# -- seeds ---------------------------------------------------------------------------------------

def _frames() -> list[bytes]:
    out = []
    with open(CAPTURE / "kv_events.frames.jsonl") as f:
        for i, line in enumerate(f):
            if i % 8 == 0:  # every 8th of the 514 real batches: stored, removed and mixed ones
                payload = base64.b64decode(json.loads(line)[2])
                out.append(bytes([i & 1]) + payload)
    return out


def _spans() -> list[ExportTraceServiceRequest]:
    out = []
    for name in ("otlp_000.pb", "otlp_001.pb"):
        msg = ExportTraceServiceRequest.FromString((CAPTURE / name).read_bytes())
        for rs in msg.resource_spans:
            for ss in rs.scope_spans:
                for span in list(ss.spans)[:6]:
                    one = ExportTraceServiceRequest()
                    r = one.resource_spans.add()
                    r.resource.CopyFrom(rs.resource)
                    s = r.scope_spans.add()
                    s.scope.CopyFrom(ss.scope)
                    s.spans.add().CopyFrom(span)
                    out.append(one)
    return out


def _span_json(msg: ExportTraceServiceRequest) -> bytes:
    from google.protobuf.json_format import MessageToDict

    doc = MessageToDict(msg)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):  # OTLP JSON writes ids as hex
                span["traceId"] = base64.b64decode(span.get("traceId", "")).hex()
                span["spanId"] = base64.b64decode(span.get("spanId", "")).hex()
    return json.dumps(doc).encode()


def _lines() -> list[bytes]:
    with gzip.open(REPO / "sample_data" / "conversation_trace.jsonl.gz", "rb") as f:
        mooncake = [next(f).strip() for _ in range(4)]
    bailian = [json.dumps({"chat_id": 5, "parent_chat_id": -1, "timestamp": 61.5, "input_length": 40,
                           "output_length": 3, "type": "text", "turn": 1, "hash_ids": [1, 2, 3]}).encode(),
               json.dumps({"chat_id": 6, "parent_chat_id": 5, "timestamp": 62.0, "input_length": 32,
                           "output_length": 9, "type": "text", "turn": 2, "hash_ids": [1, 2]}).encode()]
    gateway = [json.dumps({"request_id": "r-1", "arrival": "2026-11-30T12:00:00Z", "replica": "vllm-0",
                           "model": "llama-3.1-8b", "tenant": "acme", "prompt_tokens": 40, "block_size": 16,
                           "block_hashes": [17, 42, 99]}).encode(),
               json.dumps({"request_id": "r-2", "arrival_ns": 1_796_000_000_000_000_000, "prompt_tokens": 8,
                           "block_size": 4, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "ttft_ms": 12.5,
                           "cached_tokens": 4, "output_tokens": 2, "hash_algo": "sha256_cbor"}).encode(),
               json.dumps({"request_id": "r-3", "arrival_s": 1796000000.25, "prompt_tokens": 20,
                           "block_hashes": ["00ff" * 16, "0x1f"]}).encode()]
    lmcache = [json.dumps({"timestamp": 1711929600.123, "request_id": "req-abc", "model_name": "m",
                           "chunk_size": 256, "seq_len": 600,
                           "chunk_hashes": ["0x" + "ab" * 32, "0x1f", "-0x1"]}).encode()]
    fmt = {f: i for i, f in enumerate(LINE_FORMATS)}
    return ([bytes([fmt["mooncake"]]) + x for x in mooncake] + [bytes([fmt["bailian"]]) + x for x in bailian]
            + [bytes([fmt["gateway"]]) + x for x in gateway]
            + [bytes([fmt["lmcache-lookup"]]) + x for x in lmcache])


def _families() -> list[bytes]:
    text = (CAPTURE / "metrics.txt").read_text()
    out, current = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith("# HELP") and current:
            out.append("".join(current).encode())
            current = []
        current.append(line)
    if current:
        out.append("".join(current).encode())
    small = [f for f in out if len(f) < 2048]
    return small[::3] + [f for f in out if b"vllm:prefix_cache" in f and len(f) < 8192]


def seeds(name: str) -> list[bytes]:
    """The real inputs a decoder's fuzzing starts from."""
    if name == "vllm_events":
        return _frames()
    if name == "otlp_protobuf":
        return [m.SerializeToString() for m in _spans()]
    if name == "otlp_json":
        return [_span_json(m) for m in _spans()[:6]]
    if name == "trace_lines":
        return _lines()
    if name == "prometheus":
        return _families()
    raise KeyError(name)


SEEDS = seeds


# -- structure-aware protobuf edits ----------------------------------------------------------------

_PB_TIMES = (0, 1, 2**63 - 1, 2**63, 2**64 - 1, 1_796_000_000_000_000_000, 9_223_372_036_854_775_000)


def protobuf_mutant(data: bytes, rng: Any) -> bytes | None:
    """A span of ``data`` with one impossible time or attribute value; None if it does not parse."""
    from kvlens.collector.otlp import _WANTED

    try:
        msg = ExportTraceServiceRequest.FromString(data)
    except Exception:
        return None
    spans = [s for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans]
    if not spans:
        return None
    span = rng.choice(spans)
    op = rng.randrange(4)
    if op == 0:
        setattr(span, rng.choice(("start_time_unix_nano", "end_time_unix_nano")), rng.choice(_PB_TIMES))
    elif op == 1 or not span.attributes:
        a = span.attributes.add()
        a.key = rng.choice(sorted(_WANTED))
        _set_value(a.value, rng)
    else:
        _set_value(rng.choice(list(span.attributes)).value, rng)
    return msg.SerializeToString()


def _set_value(v: Any, rng: Any) -> None:
    choice = rng.randrange(4)
    if choice == 0:
        v.double_value = rng.choice((float("inf"), float("-inf"), float("nan"), 1e10, 1e300, -1.0, 1e-300))
    elif choice == 1:
        v.int_value = rng.choice((2**31, -1, 2**63 - 1, -(2**63), 0))
    elif choice == 2:
        v.string_value = rng.choice(("", "x", "-0", "é"))
    else:
        v.bool_value = True
