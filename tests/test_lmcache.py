"""import lmcache-lookup: LMCache lookup hash log lines -> requests and chunk-granular request_blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from kvlens.cli import cli
from kvlens.collector.importer import import_files
from kvlens.errors import InputError
from kvlens.lake import open_lake

DIGEST = "0x" + "ab" * 24 + "0011223344556677"  # a 32-byte digest: its last 8 bytes are the key
LINES: list[object] = [
    {"timestamp": 1711929600.123, "request_id": "req-a", "model_name": "DeepSeek-V3", "chunk_size": 256,
     "seq_len": 600, "dtypes": ["float8_e4m3fn"], "shapes": [[32, 256, 128]],
     "chunk_hashes": [DIGEST, "0x1f", "0xffffffffffffffff"]},
    {"timestamp": 1711929601, "request_id": "req-b", "model_name": "DeepSeek-V3", "chunk_size": 256,
     "seq_len": 512, "chunk_hashes": ["0x1f", "-0x1"]},   # Python hex() of a negative int
    {"timestamp": 1711929602.5, "request_id": "req-a", "model_name": "DeepSeek-V3", "chunk_size": 256,
     "seq_len": 600, "chunk_hashes": [DIGEST, "0x1f", "0x2"]},  # looked up again: a repeat
    {"timestamp": 1711929603.0, "request_id": "", "model_name": "DeepSeek-V3", "chunk_size": 16,
     "seq_len": 20, "chunk_hashes": ["0x5"]},              # full chunks only
]


def _lake_rows(lake: Path, sql: str) -> list[tuple[object, ...]]:
    con = duckdb.connect()
    open_lake(con, lake)
    return con.execute(sql).fetchall()


def test_lookup_rows_exact(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl("lookup_hashes_20240401_000000_000000.jsonl", LINES)
    result = import_files("lmcache-lookup", [path], tmp_path / "lake", scenario="lm")
    assert (result.requests, result.blocks, result.repeats, result.bad_lines) == (3, 6, 1, 0)
    assert _lake_rows(tmp_path / "lake", """
        SELECT request_id, scenario, arrival_ns, model, prompt_tokens, output_tokens, cached_tokens, source
        FROM requests ORDER BY arrival_ns""") == [
        ("req-a", "lm", 1_711_929_600_123_000_000, "DeepSeek-V3", 600, None, None, "lmcache"),
        ("req-b", "lm", 1_711_929_601_000_000_000, "DeepSeek-V3", 512, None, None, "lmcache"),
        ("lookup_hashes_20240401_000000_000000:0000004", "lm", 1_711_929_603_000_000_000, "DeepSeek-V3",
         20, None, None, "lmcache"),
    ]
    assert _lake_rows(tmp_path / "lake", """
        SELECT request_id, position, block_hash, content_hash, block_tokens, block_size_tokens, namespace
        FROM request_blocks ORDER BY arrival_ns, position""") == [
        ("req-a", 0, 0x0011223344556677, 0x0011223344556677, 256, 256, "DeepSeek-V3"),
        ("req-a", 1, 0x1F, 0x1F, 256, 256, "DeepSeek-V3"),
        ("req-a", 2, 2**64 - 1, 2**64 - 1, 88, 256, "DeepSeek-V3"),   # the partial last chunk
        ("req-b", 0, 0x1F, 0x1F, 256, 256, "DeepSeek-V3"),
        ("req-b", 1, 2**64 - 1, 2**64 - 1, 256, 256, "DeepSeek-V3"),  # -1 folded to unsigned
        ("lookup_hashes_20240401_000000_000000:0000004", 0, 5, 5, 16, 16, "DeepSeek-V3"),
    ]


def test_bad_lines_name_the_field(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    bad = {"timestamp": 1.0, "request_id": "x", "model_name": "m", "chunk_size": 256, "seq_len": 1000,
           "chunk_hashes": ["0x1", "0x2"]}  # 1000 tokens need 3 or 4 chunks of 256
    path = write_jsonl("lookups.jsonl", [LINES[0], bad, {**bad, "chunk_hashes": ["0xzz"]}])
    with pytest.raises(InputError, match=r"line 2.*'chunk_hashes'.*2 blocks do not fit 1000"):
        import_files("lmcache-lookup", [path], tmp_path / "lake")
    result = import_files("lmcache-lookup", [path], tmp_path / "lake", skip_bad_lines=True)
    assert (result.requests, result.bad_lines) == (1, 2)
    assert "not a hex digest" in result.first_bad[1]


def test_cli_import_lmcache_lookup(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl("lookups.jsonl", LINES)
    out = CliRunner().invoke(cli, ["import", "lmcache-lookup", str(path), "--lake", str(tmp_path / "lake"),
                                   "--model", "dsv3"])
    assert out.exit_code == 0, out.output
    assert "imported 3 requests and 6 blocks" in out.output
    assert "1 repeated lookups" in out.output
    assert _lake_rows(tmp_path / "lake", "SELECT DISTINCT model FROM requests") == [("dsv3",)]
