"""Collector for the Mooncake FAST'25 traces (JSONL): one line -> a request and its 512-token blocks.

Fields (FORMATS.md 5.1): ``timestamp`` (ms from the trace start), ``input_length``,
``output_length``, ``hash_ids`` (prefix-chained ids of 512-token blocks; the last one
covers a partial block when ``input_length`` is not a multiple of 512).
"""

from __future__ import annotations

from typing import Any

from kvlens.collector.fields import INT64_MAX, FieldError, Parsed, Parser, hash_id_request, need_int

__all__ = ["BLOCK_TOKENS", "parser"]

BLOCK_TOKENS = 512


def parser(*, model: str | None, t0_ns: int) -> Parser:
    namespace = model or "mooncake"

    def parse(rec: Any, *, lineno: int, stem: str) -> Parsed:
        ts_ms = need_int(rec, "timestamp", maximum=INT64_MAX)
        if t0_ns + ts_ms * 1_000_000 > INT64_MAX:
            raise FieldError("timestamp", f"{ts_ms} ms after --t0 is past the year 2262")
        return hash_id_request(rec, {
            "request_id": f"{stem}:{lineno:07d}",
            "arrival_ns": t0_ns + ts_ms * 1_000_000,
            "model": model,
            "source": "mooncake",
        }, block_tokens=BLOCK_TOKENS, namespace=namespace)

    return parse
