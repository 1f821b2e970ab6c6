"""Collector for LMCache lookup hash logs (JSONL): a lookup -> a request and its chunk-granular blocks.

LMCache (0.5.6, ``lmcache/v1/mp_observability``, ``--lookup-hash-log-dir``; FORMATS.md 2.5)
writes one JSON object per lookup to rotating ``lookup_hashes_*.jsonl`` files::

    {"timestamp": 1711929600.123, "request_id": "req-abc", "model_name": "DeepSeek-V3",
     "chunk_size": 256, "seq_len": 1024, "dtypes": [...], "shapes": [...],
     "chunk_hashes": ["0xab...", ...]}

Assumed field semantics:

- ``timestamp``: **seconds since the Unix epoch** (float), the lookup event's wall-clock time
  (LMCache formats it with ``datetime.fromtimestamp`` for the file names); it becomes
  ``arrival_ns``, rounded to the microsecond. ``--t0`` does not apply: the times are absolute.
- ``request_id``: the engine's request id; an empty one becomes ``<file stem>:<line>``.
- ``model_name``: recorded as ``requests.model`` and the blocks' ``namespace`` (``--model``
  overrides both).
- ``chunk_size``: tokens per chunk; it is the rows' ``block_size_tokens``.
- ``seq_len``: the tokens looked up; it is ``prompt_tokens``.
- ``chunk_hashes``: prefix-chained chunk keys in order, hex (``"0x"`` + digest bytes, or
  Python ``hex()`` of an int, possibly negative); a digest longer than 8 bytes keeps its last
  8 bytes, as vLLM's events do, and negative ints fold to unsigned 64-bit. There are
  floor(seq_len / chunk_size) hashes, or one more for a partial last chunk (its
  ``block_tokens`` is the remainder). The chain covers token content only, so each hash is
  also the row's ``content_hash``.
- ``dtypes`` / ``shapes``: ignored.

A request that LMCache looked up more than once (the scheduler asks again while the request
waits) keeps its first lookup; the later ones are skipped and counted as repeats.
"""

from __future__ import annotations

from typing import Any

from kvlens.collector.fields import (
    FieldError,
    Parsed,
    Parser,
    need_int,
    need_number,
    opt_str,
    seconds_ns,
    tail_tokens,
)
from kvlens.collector.hashing import fold_u64

__all__ = ["parser"]

def _hex_hashes(rec: dict[str, Any]) -> list[int]:
    value = rec.get("chunk_hashes")
    if not isinstance(value, list):
        raise FieldError("chunk_hashes", f"expected a list of hex digests, got {value!r:.40}")
    out = []
    for i, h in enumerate(value):
        if isinstance(h, int) and not isinstance(h, bool):
            out.append(fold_u64(h))
            continue
        if not isinstance(h, str):
            raise FieldError("chunk_hashes", f"element {i} is not a hex string: {h!r:.40}")
        negative = h.startswith("-")
        digits = h.lstrip("-")
        digits = digits[2:] if digits[:2].lower() == "0x" else digits
        try:
            v = int(digits[-16:], 16) if digits else None
        except ValueError:
            v = None
        if v is None:
            raise FieldError("chunk_hashes", f"element {i} is not a hex digest: {h!r:.40}")
        out.append(fold_u64(-v if negative else v))
    return out


def parser(*, model: str | None, t0_ns: int) -> Parser:
    seen: set[str] = set()

    def parse(rec: Any, *, lineno: int, stem: str) -> Parsed | None:
        chunk = need_int(rec, "chunk_size", minimum=1)
        seq_len = need_int(rec, "seq_len")
        # A float of epoch seconds carries about a microsecond: round there, not to float noise.
        ts_ns = seconds_ns(need_number(rec, "timestamp"), "timestamp", resolution_ns=1000)
        rid = opt_str(rec, "request_id") or f"{stem}:{lineno:07d}"
        name = model or opt_str(rec, "model_name") or "lmcache"
        hashes = _hex_hashes(rec)
        tokens = tail_tokens(seq_len, len(hashes), chunk, "chunk_hashes")
        if rid in seen:
            return None
        seen.add(rid)
        return Parsed(
            request={"request_id": rid, "arrival_ns": ts_ns, "model": name, "prompt_tokens": seq_len,
                     "source": "lmcache"},
            block_hashes=hashes, content_hashes=hashes, block_tokens=tokens, block_size_tokens=chunk,
            namespace=name,
        )

    return parse
