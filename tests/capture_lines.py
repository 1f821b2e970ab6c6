"""A shipped vLLM capture's client log as gateway lines (token ids, hashed as the engine hashes them)."""

from __future__ import annotations

import json
from pathlib import Path


def gateway_lines(capture: Path, out: Path, model: str = "tiny") -> Path:
    """Write ``capture``/client.jsonl as `kvlens import gateway` lines to ``out`` and return ``out``."""
    with open(capture / "client.jsonl") as src, open(out, "w") as dst:
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
