"""Collector for router / gateway logs in kvlens's gateway JSONL: a line -> a request and its blocks.

One JSON object per line (README, "Gateway log format"):

- ``request_id`` (string, required);
- arrival: ``arrival_ns`` (int, ns since the epoch), or ``arrival_s`` (number, seconds since
  the epoch), or ``arrival`` (RFC 3339 string); one is required;
- ``replica``, ``model``, ``tenant``, ``session_id``, ``namespace`` (strings, optional);
- ``prompt_tokens`` (int, required), ``output_tokens``, ``cached_tokens`` (ints, optional),
  ``ttft_ms`` (number, optional);
- ``cached_tokens_details`` (object, optional): the engine's split of ``cached_tokens`` by tier,
  as SGLang reports it per request (``meta_info.cached_tokens_details``: ``device``, ``host``,
  ``storage`` ints; other keys ignored);
- ``block_size`` (int, default 16) and ``block_hashes``: the prompt's block keys in order,
  ints (signed ones are folded to unsigned 64-bit) or hex digests (the last 8 bytes are
  kept, as vLLM's events do); full blocks only, or full blocks plus the partial tail;
- or ``token_ids`` (the prompt's token ids, as many as ``prompt_tokens``) in place of
  ``block_hashes``: the full blocks are hashed as vLLM does (collector.hashing), with
  ``hash_algo`` (``sha256``, the engine default, or ``sha256_cbor``), ``hash_seed`` (the
  engine's PYTHONHASHSEED; default vLLM's fixed seed), ``cache_salt``, ``lora_name`` and
  ``lora_path`` from the line when given. With ``token_ids``, ``content_hash`` is set too
  (kvlens's token-content chain, the one the event collector writes), and ``token_hash``
  (each full block's own token ids, not chained: for the prompt-hygiene analysis).
"""

from __future__ import annotations

from typing import Any, cast

from kvlens.collector.fields import (
    INT64_MAX,
    FieldError,
    Parsed,
    Parser,
    need_hashes,
    need_int,
    need_number,
    opt_str,
    rfc3339_ns,
    seconds_ns,
    tail_tokens,
)

__all__ = ["DEFAULT_BLOCK_TOKENS", "parser"]

DEFAULT_BLOCK_TOKENS = 16


def _arrival_ns(rec: dict[str, Any]) -> int:
    if "arrival_ns" in rec:
        return need_int(rec, "arrival_ns", maximum=INT64_MAX)
    if "arrival_s" in rec:
        return seconds_ns(need_number(rec, "arrival_s"), "arrival_s")
    text = rec.get("arrival")
    if not isinstance(text, str):
        raise FieldError("arrival_ns", "no arrival time: give arrival_ns, arrival_s or arrival")
    try:
        return rfc3339_ns(text)
    except ValueError as e:
        raise FieldError("arrival", f"not an RFC 3339 time with a zone: {e}") from None


def _token_blocks(rec: dict[str, Any], block: int,
                  prompt: int) -> tuple[list[int] | None, list[int | None], list[int | None]]:
    """(vLLM block hashes when the line has no block_hashes, content hashes, token hashes)
    from token_ids."""
    from kvlens.collector.hashing import ALGOS, content_hashes, token_hashes, vllm_block_hashes

    tokens = rec.get("token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 2**32 for t in tokens):
        raise FieldError("token_ids", "expected a list of token ids (integers from 0 to 2**32-1)")
    if len(tokens) != prompt:
        raise FieldError("token_ids", f"{len(tokens)} token ids for {prompt} prompt tokens")
    contents: list[int | None] = list(content_hashes(tokens, block) or [])
    own: list[int | None] = list(token_hashes(tokens, block) or [])
    if "block_hashes" in rec:
        return None, contents, own
    algo = opt_str(rec, "hash_algo") or "sha256"
    if algo not in ALGOS:
        raise FieldError("hash_algo", f"{algo!r} is not one of {', '.join(ALGOS)}")
    hashed = vllm_block_hashes(tokens, block, algo=algo, seed=opt_str(rec, "hash_seed"),
                               cache_salt=opt_str(rec, "cache_salt"), lora_name=opt_str(rec, "lora_name"),
                               lora_path=opt_str(rec, "lora_path"))
    return [b.value for b in hashed], contents, own


def _opt_number(rec: dict[str, Any], key: str) -> float | None:
    return need_number(rec, key) if rec.get(key) is not None else None


# cached_tokens_details key -> requests column
_DETAILS = {"device": "cached_device_tokens", "host": "cached_host_tokens",
            "storage": "cached_storage_tokens"}


def _cache_details(rec: dict[str, Any]) -> dict[str, int | None]:
    details = rec.get("cached_tokens_details")
    if details is None:
        return dict.fromkeys(_DETAILS.values())
    if not isinstance(details, dict):
        raise FieldError("cached_tokens_details", "expected an object of device, host, storage token counts")
    try:
        return {col: need_int(details, key) if key in details else None for key, col in _DETAILS.items()}
    except FieldError as e:
        raise FieldError("cached_tokens_details", str(e)) from None


def parser(*, model: str | None, t0_ns: int) -> Parser:
    del t0_ns  # gateway times are absolute

    def parse(rec: Any, *, lineno: int, stem: str) -> Parsed:
        prompt = need_int(rec, "prompt_tokens")
        request_id = opt_str(rec, "request_id")
        if not request_id:
            raise FieldError("request_id", "missing or empty")
        block = need_int(rec, "block_size", minimum=1) if "block_size" in rec else DEFAULT_BLOCK_TOKENS
        if "block_hashes" not in rec and "token_ids" not in rec:
            raise FieldError("block_hashes", "missing: give the prompt's block hashes or its token_ids")
        from_tokens, contents, own = (_token_blocks(rec, block, prompt) if "token_ids" in rec
                                      else (None, [], []))
        hashes = from_tokens if from_tokens is not None else need_hashes(rec, "block_hashes")
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
                **_cache_details(rec),
                "source": "gateway",
            },
            block_hashes=hashes,
            block_tokens=tail_tokens(prompt, len(hashes), block, "block_hashes"),
            # a hashed partial tail has no content hash: NULL (the importer writes None through)
            content_hashes=cast("list[int]", (contents + [None] * len(hashes))[:len(hashes)]) if contents
            else None,
            block_size_tokens=block,
            namespace=opt_str(rec, "namespace") or row_model,
            token_hashes=(own + [None] * len(hashes))[:len(hashes)] if own else None,
        )

    return parse
