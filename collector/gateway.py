"""Collector for router / gateway logs in kvlens's gateway JSONL: a line -> a request and its blocks.

One JSON object per line (README, "Gateway log format"):

- ``request_id`` (string, required);
- arrival: ``arrival_ns`` (int, ns since the epoch), or ``arrival_s`` (number, seconds since
  the epoch), or ``arrival`` (RFC 3339 string); one is required;
- ``replica``, ``model``, ``tenant``, ``session_id``, ``namespace`` (strings, optional);
- ``prompt_tokens`` (int, required), ``output_tokens``, ``cached_tokens`` (ints, optional),
  ``ttft_ms`` (number, optional);
- ``block_size`` (int, default 16) and ``block_hashes``: the prompt's block keys in order,
  ints (signed ones are folded to unsigned 64-bit) or hex digests (the last 8 bytes are
  kept, as vLLM's events do); full blocks only, or full blocks plus the partial tail;
- ``token_ids`` instead of ``block_hashes`` needs the vLLM-compatible hasher and is refused
  until kvlens has it.
"""

from __future__ import annotations

from typing import Any

from collector.importer import (
    INT64_MAX,
    FieldError,
    Parsed,
    Parser,
    need_hashes,
    need_int,
    need_number,
    opt_str,
    rfc3339_ns,
    tail_tokens,
)

__all__ = ["DEFAULT_BLOCK_TOKENS", "parser"]

DEFAULT_BLOCK_TOKENS = 16


def _arrival_ns(rec: dict[str, Any]) -> int:
    if "arrival_ns" in rec:
        return need_int(rec, "arrival_ns", maximum=INT64_MAX)
    if "arrival_s" in rec:
        return round(need_number(rec, "arrival_s") * 1e9)
    text = rec.get("arrival")
    if not isinstance(text, str):
        raise FieldError("arrival_ns", "no arrival time: give arrival_ns, arrival_s or arrival")
    try:
        return rfc3339_ns(text)
    except ValueError as e:
        raise FieldError("arrival", f"not an RFC 3339 time with a zone: {e}") from None


def _opt_number(rec: dict[str, Any], key: str) -> float | None:
    return need_number(rec, key) if rec.get(key) is not None else None


def parser(*, model: str | None, t0_ns: int) -> Parser:
    del t0_ns  # gateway times are absolute

    def parse(rec: Any, *, lineno: int, stem: str) -> Parsed:
        prompt = need_int(rec, "prompt_tokens")
        request_id = opt_str(rec, "request_id")
        if not request_id:
            raise FieldError("request_id", "missing or empty")
        block = need_int(rec, "block_size", minimum=1) if "block_size" in rec else DEFAULT_BLOCK_TOKENS
        if "block_hashes" not in rec:
            if "token_ids" in rec:
                raise FieldError("token_ids", "token ids need the vLLM-compatible hasher, which this "
                                              "kvlens does not have yet: log block_hashes instead")
            raise FieldError("block_hashes", "missing: give the prompt's block hashes")
        hashes = need_hashes(rec, "block_hashes")
        row_model = opt_str(rec, "model") or model
        return Parsed(
            request={
                "request_id": request_id,
                "arrival_ns": _arrival_ns(rec),
                "replica": opt_str(rec, "replica"),
                "model": row_model,
                "tenant": opt_str(rec, "tenant"),
                "session_id": opt_str(rec, "session_id"),
                "prompt_tokens": prompt,
                "output_tokens": need_int(rec, "output_tokens") if "output_tokens" in rec else None,
                "cached_tokens": need_int(rec, "cached_tokens") if "cached_tokens" in rec else None,
                "ttft_ms": _opt_number(rec, "ttft_ms"),
                "source": "gateway",
            },
            block_hashes=hashes,
            block_tokens=tail_tokens(prompt, len(hashes), block, "block_hashes"),
            block_size_tokens=block,
            namespace=opt_str(rec, "namespace") or row_model,
        )

    return parse
