"""A shipped vLLM capture's client log as gateway lines (token ids, hashed as the engine hashes them)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def capture_file(capture: Path, name: str) -> Path:
    """``capture``/``name``, or its gzip (``name``.gz: the larger captures are shipped compressed)."""
    plain = capture / name
    return plain if plain.exists() else capture / f"{name}.gz"


def gateway_lines(capture: Path, out: Path, model: str = "tiny") -> Path:
    """Write ``capture``/client.jsonl (or .jsonl.gz) as `kvlens import gateway` lines to ``out`` and
    return ``out``."""
    client = capture_file(capture, "client.jsonl")
    with (gzip.open(client, "rt") if client.suffix == ".gz" else open(client)) as src, open(out, "w") as dst:
        for line in src:
            r = json.loads(line)
            usage = r["usage"]
            dst.write(json.dumps({
                "request_id": r["request_id"], "arrival_s": r["arrival_unix"], "replica": "replica-a",
                "model": model, "session_id": r["session"], "prompt_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "token_ids": r["prompt_token_ids"], "block_size": 32, "hash_algo": "sha256_cbor",
                "hash_seed": "0"}) + "\n")
    return out
