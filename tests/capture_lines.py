"""A shipped vLLM capture's client log as gateway lines (token ids, hashed as the engine hashes them),
and the capture imported into a lake."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from click.testing import CliRunner

from kvlens.cli import cli


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


def capture_lake(capture: Path, tmp: Path, model: str, scenario: str = "capture") -> Path:
    """``capture``'s frames (`kvlens import vllm-events`) and client log (as gateway lines, model
    ``model``) imported into ``tmp``/lake as ``scenario``; the lake's path."""
    lake = tmp / "lake"
    for args in (["import", "vllm-events", str(capture_file(capture, "kv_events.frames.jsonl"))],
                 ["import", "gateway", str(gateway_lines(capture, tmp / "gateway.jsonl", model))]):
        result = CliRunner().invoke(cli, [*args, "--scenario", scenario, "--lake", str(lake)])
        assert result.exit_code == 0, (args, result.output)
    return lake


def analyze_capture(lake: Path, db: Path, model: str, scenario: str = "capture") -> Path:
    """`kvlens analyze` of ``scenario`` in ``lake`` into ``db``, with the bytes of ``model``; ``db``."""
    result = CliRunner().invoke(cli, ["analyze", "--lake", str(lake), "--db", str(db), "--model", model,
                                      "--scenario", scenario])
    assert result.exit_code == 0, result.output
    return db
