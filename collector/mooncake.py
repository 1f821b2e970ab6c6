"""Collector for the Mooncake FAST'25 traces (JSONL): one line -> a request and its 512-token blocks.

Fields (FORMATS.md 5.1): ``timestamp`` (ms from the trace start), ``input_length``,
``output_length``, ``hash_ids`` (prefix-chained ids of 512-token blocks; the last one
covers a partial block when ``input_length`` is not a multiple of 512).
"""

from __future__ import annotations

from typing import Any

from collector.importer import INT64_MAX, FieldError, Parsed, Parser, need_hashes, need_int, tail_tokens

__all__ = ["BLOCK_TOKENS", "parser"]

BLOCK_TOKENS = 512


def parser(*, model: str | None, t0_ns: int) -> Parser:
    namespace = model or "mooncake"

    def parse(rec: Any, *, lineno: int, stem: str) -> Parsed:
        ts_ms = need_int(rec, "timestamp", maximum=INT64_MAX)
        if t0_ns + ts_ms * 1_000_000 > INT64_MAX:
            raise FieldError("timestamp", f"{ts_ms} ms after --t0 is past the year 2262")
        prompt = need_int(rec, "input_length")
        hashes = need_hashes(rec, "hash_ids")
        # The trace ids are already prefix-chained content ids: they serve as both keys.
        return Parsed(
            request={
                "request_id": f"{stem}:{lineno:07d}",
                "arrival_ns": t0_ns + ts_ms * 1_000_000,
                "model": model,
                "prompt_tokens": prompt,
                "output_tokens": need_int(rec, "output_length"),
                "source": "mooncake",
            },
            block_hashes=hashes,
            content_hashes=hashes,
            block_tokens=tail_tokens(prompt, len(hashes), BLOCK_TOKENS, "hash_ids"),
            block_size_tokens=BLOCK_TOKENS,
            namespace=namespace,
        )

    return parse
