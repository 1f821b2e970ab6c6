"""Tests for collector.importer and its formats: trace lines -> requests / request_blocks in the lake."""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import kvlens.collector.fields as fields
import kvlens.collector.importer as importer
from kvlens.collector.importer import DEFAULT_T0_NS, import_files
from kvlens.errors import InputError
from kvlens.lake import SegmentWriter
from kvlens.query import query
from kvlens.sample_data import MOONCAKE_CONVERSATION

REPO = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000_000_000_000
U64 = (1 << 64) - 1

REQ_COLS = ("request_id, scenario, arrival_ns, replica, model, tenant, session_id, prompt_tokens, "
            "output_tokens, cached_tokens, ttft_ms, source")
BLOCK_COLS = ("request_id, scenario, arrival_ns, position, block_hash, content_hash, block_tokens, "
              "block_size_tokens, namespace")


def _query(lake: Path, sql: str, params: list[object] | None = None) -> list[tuple[object, ...]]:
    return query(sql, lake=lake, params=params)[1]


def _requests(lake: Path, scenario: str | None = None) -> list[tuple[object, ...]]:
    where = "WHERE scenario = ?" if scenario else ""
    return _query(lake, f"SELECT {REQ_COLS} FROM requests {where} ORDER BY scenario, request_id",
                  [scenario] if scenario else None)


def _blocks(lake: Path, scenario: str | None = None) -> list[tuple[object, ...]]:
    where = "WHERE scenario = ?" if scenario else ""
    return _query(lake, f"SELECT {BLOCK_COLS} FROM request_blocks {where} "
                        "ORDER BY scenario, request_id, position", [scenario] if scenario else None)


def _table_files(lake: Path) -> set[Path]:
    """Every file (any name) under the two tables' directories."""
    out: set[Path] = set()
    for table in ("requests", "request_blocks"):
        out |= {p for p in (lake / table).rglob("*") if p.is_file()}
    return out


def _assert_committed_layout_only(lake: Path) -> None:
    for p in _table_files(lake):
        rel = p.relative_to(lake)
        assert len(rel.parts) == 4, f"file outside <table>/scenario=*/date=*/: {rel}"
        assert rel.parts[1].startswith("scenario=") and rel.parts[2].startswith("date="), rel
        assert rel.suffix == ".parquet" and not rel.name.startswith("."), f"leftover: {rel}"


def _staged(lake: Path) -> list[Path]:
    return sorted((lake / ".staging").rglob("*.parquet"))


@pytest.fixture
def tiny_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every request a batch and every batch a segment, so staging fills before a failure."""
    monkeypatch.setattr(importer, "_BATCH_REQUESTS", 1)
    monkeypatch.setattr(importer, "SegmentWriter", functools.partial(SegmentWriter, flush_rows=1))


# -- Mooncake ---------------------------------------------------------------------------------


def test_mooncake_rows_exact(tmp_path: Path, mooncake3: Path) -> None:
    lake = tmp_path / "lake"
    result = import_files("mooncake", [mooncake3], lake, scenario="mc", t0_ns=T0)
    assert (result.requests, result.blocks, result.bad_lines) == (3, 8, 0)

    big = 2**63 + 5
    assert _requests(lake) == [
        ("trace:0000001", "mc", T0, None, None, None, None, 1024, 5, None, None, "mooncake"),
        ("trace:0000002", "mc", T0 + 1500 * 10**6, None, None, None, None, 1300, 7, None, None, "mooncake"),
        ("trace:0000003", "mc", T0 + 2750 * 10**6, None, None, None, None, 1100, 9, None, None, "mooncake"),
    ]
    a1, a2, a3 = T0, T0 + 1_500_000_000, T0 + 2_750_000_000
    assert _blocks(lake) == [
        ("trace:0000001", "mc", a1, 0, 10, 10, 512, 512, "mooncake"),
        ("trace:0000001", "mc", a1, 1, 11, 11, 512, 512, "mooncake"),
        ("trace:0000002", "mc", a2, 0, 20, 20, 512, 512, "mooncake"),
        ("trace:0000002", "mc", a2, 1, big, big, 512, 512, "mooncake"),
        ("trace:0000002", "mc", a2, 2, 22, 22, 1300 - 1024, 512, "mooncake"),
        ("trace:0000003", "mc", a3, 0, 10, 10, 512, 512, "mooncake"),
        ("trace:0000003", "mc", a3, 1, 11, 11, 512, 512, "mooncake"),
        ("trace:0000003", "mc", a3, 2, 30, 30, 1100 - 1024, 512, "mooncake"),
    ]


def test_mooncake_default_t0_and_model(tmp_path: Path, mooncake3: Path) -> None:
    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake, model="llama-3.1-70b")
    rows = _query(lake, "SELECT DISTINCT scenario, model FROM requests")
    assert rows == [("default", "llama-3.1-70b")]
    assert _query(lake, "SELECT min(arrival_ns) FROM requests") == [(DEFAULT_T0_NS,)]
    assert _query(lake, "SELECT DISTINCT namespace FROM request_blocks") == [("llama-3.1-70b",)]


def test_real_trace_counts_and_tokens(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    result = import_files("mooncake", [MOONCAKE_CONVERSATION], lake, scenario="conv")
    assert (result.requests, result.blocks, result.bad_lines) == (12_031, 288_500, 0)
    counts = _query(lake, "SELECT (SELECT count(*) FROM requests), (SELECT count(DISTINCT request_id) "
                          "FROM requests), (SELECT count(*) FROM request_blocks)")
    assert counts == [(12_031, 12_031, 288_500)]
    mismatched = _query(lake, """
        SELECT count(*) FROM requests r
        LEFT JOIN (SELECT request_id, sum(block_tokens) AS t FROM request_blocks GROUP BY 1) b
        USING (request_id)
        WHERE coalesce(b.t, 0) <> r.prompt_tokens""")
    assert mismatched == [(0,)]


# -- Bailian ----------------------------------------------------------------------------------


def test_bailian_session_chain_and_blocks(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl("qwen.jsonl", [
        {"chat_id": 100, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40, "output_length": 3,
         "type": "text", "turn": 1, "hash_ids": [1, 2, 3]},
        {"chat_id": 205, "parent_chat_id": 100, "timestamp": 1.25, "input_length": 48, "output_length": 4,
         "type": "text", "turn": 2, "hash_ids": [1, 2, 4]},
        {"chat_id": 310, "parent_chat_id": 205, "timestamp": 2, "input_length": 50, "output_length": 5,
         "type": "text", "turn": 3, "hash_ids": [1, 2, 4]},
        {"chat_id": 400, "parent_chat_id": -1, "timestamp": 3.0, "input_length": 8, "output_length": 1,
         "type": "text", "turn": 1, "hash_ids": [9]},
    ])
    lake = tmp_path / "lake"
    result = import_files("bailian", [path], lake, scenario="bl", t0_ns=T0)
    assert (result.requests, result.blocks) == (4, 10)

    reqs = _query(lake, "SELECT request_id, arrival_ns, session_id, prompt_tokens, output_tokens, source "
                        "FROM requests ORDER BY arrival_ns")
    assert reqs == [
        ("100", T0 + 500_000_000, "100", 40, 3, "bailian"),
        ("205", T0 + 1_250_000_000, "100", 48, 4, "bailian"),
        ("310", T0 + 2_000_000_000, "100", 50, 5, "bailian"),
        ("400", T0 + 3_000_000_000, "400", 8, 1, "bailian"),
    ]
    blocks = _query(lake, "SELECT request_id, list(block_tokens ORDER BY position), "
                          "list(block_hash ORDER BY position), bool_and(block_hash = content_hash), "
                          "min(block_size_tokens), max(block_size_tokens), min(namespace) "
                          "FROM request_blocks GROUP BY 1 ORDER BY 1")
    assert blocks == [
        ("100", [16, 16, 8], [1, 2, 3], True, 16, 16, "bailian"),   # partial tail hashed
        ("205", [16, 16, 16], [1, 2, 4], True, 16, 16, "bailian"),  # exact multiple
        ("310", [16, 16, 16], [1, 2, 4], True, 16, 16, "bailian"),  # only full blocks hashed
        ("400", [8], [9], True, 16, 16, "bailian"),
    ]


def test_bailian_chat_ids_are_64_bit(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    # The trace's chat ids are randomized integers: they do not fit 32 bits.
    big = 2**40 + 7
    path = write_jsonl("qwen.jsonl", [
        {"chat_id": big, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1,
         "hash_ids": [1]},
        {"chat_id": -big, "parent_chat_id": big, "timestamp": 1, "input_length": 32, "output_length": 1,
         "hash_ids": [1, 2]},
    ])
    lake = tmp_path / "lake"
    import_files("bailian", [path], lake, scenario="bl", t0_ns=T0)
    assert _query(lake, "SELECT request_id, session_id FROM requests ORDER BY arrival_ns") == [
        (str(big), str(big)), (str(-big), str(big))]


# -- Gateway ----------------------------------------------------------------------------------


def test_gateway_fields(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    digest = hashlib.sha256(b"kvlens").hexdigest()
    assert len(digest) == 64
    path = write_jsonl("gw.jsonl", [
        {"request_id": "g1", "arrival_ns": 1_735_689_600_123_456_789, "replica": "r0", "tenant": "acme",
         "session_id": "s1", "model": "llama", "prompt_tokens": 40, "block_size": 16,
         "block_hashes": [-1, -(2**63), 5]},
        {"request_id": "g2", "arrival_s": 1_735_689_601.5, "prompt_tokens": 40, "block_hashes": [7, digest]},
        {"request_id": "g3", "arrival": "2025-01-01T00:00:02Z", "prompt_tokens": 16, "block_hashes": [9],
         "output_tokens": 3, "cached_tokens": 16, "ttft_ms": 12.5, "namespace": "ns-x"},
    ])
    lake = tmp_path / "lake"
    result = import_files("gateway", [path], lake, scenario="gw", model="fallback", t0_ns=T0)
    assert (result.requests, result.blocks) == (3, 6)

    fb = "fallback"
    assert _requests(lake) == [
        ("g1", "gw", 1_735_689_600_123_456_789, "r0", "llama", "acme", "s1", 40, None, None, None, "gateway"),
        ("g2", "gw", 1_735_689_601_500_000_000, None, fb, None, None, 40, None, None, None, "gateway"),
        ("g3", "gw", 1_735_689_602_000_000_000, None, fb, None, None, 16, 3, 16, 12.5, "gateway"),
    ]
    tail = int.from_bytes(bytes.fromhex(digest)[-8:], "big")
    blocks = _query(lake, "SELECT request_id, position, block_hash, content_hash, block_tokens, "
                          "block_size_tokens, namespace FROM request_blocks ORDER BY request_id, position")
    assert blocks == [
        ("g1", 0, U64, None, 16, 16, "llama"),  # signed -1 folded to 2**64 - 1
        ("g1", 1, 2**63, None, 16, 16, "llama"),
        ("g1", 2, 5, None, 8, 16, "llama"),  # 40 tokens, 3 hashes: full blocks + tail
        ("g2", 0, 7, None, 16, 16, "fallback"),
        ("g2", 1, tail, None, 16, 16, "fallback"),  # 40 tokens, 2 hashes: full blocks only
        ("g3", 0, 9, None, 16, 16, "ns-x"),
    ]


@pytest.mark.parametrize(("text", "expected"), [
    ("2025-01-01T00:00:02.25Z", 1_735_689_602_250_000_000),
    ("2025-01-01T01:00:02.123456+01:00", 1_735_689_602_123_456_000),
])
def test_gateway_rfc3339_fraction_is_exact(tmp_path: Path, write_jsonl: Callable[..., Path],
                                           text: str, expected: int) -> None:
    path = write_jsonl("gw.jsonl", [
        {"request_id": "f1", "arrival": text, "prompt_tokens": 16, "block_hashes": [1]},
    ])
    lake = tmp_path / "lake"
    import_files("gateway", [path], lake)
    assert _query(lake, "SELECT arrival_ns FROM requests") == [(expected,)]
    assert _query(lake, "SELECT arrival_ns FROM request_blocks") == [(expected,)]


def test_gateway_token_ids_hashed_as_vllm_does(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    from kvlens.collector.hashing import content_hashes, vllm_block_hashes

    tokens = list(range(100, 140))  # 2 full blocks of 16 and a tail of 8 (not hashed, as vLLM does)
    path = write_jsonl("gw.jsonl", [
        {"request_id": "t1", "arrival_ns": 1, "prompt_tokens": 40, "token_ids": tokens},
        {"request_id": "t2", "arrival_ns": 2, "prompt_tokens": 40, "token_ids": tokens, "block_size": 8,
         "hash_algo": "sha256_cbor", "hash_seed": "0", "cache_salt": "acme", "namespace": "ns"},
    ])
    lake = tmp_path / "lake"
    import_files("gateway", [path], lake)
    got = _query(lake, "SELECT request_id, position, block_hash, content_hash, block_tokens, namespace "
                       "FROM request_blocks ORDER BY request_id, position")
    t1 = vllm_block_hashes(tokens, 16)  # sha256 over pickle, vLLM's default seed
    t2 = vllm_block_hashes(tokens, 8, algo="sha256_cbor", seed="0", cache_salt="acme")
    c1, c2 = content_hashes(tokens, 16), content_hashes(tokens, 8)
    assert c1 is not None and c2 is not None
    assert got == [("t1", i, b.value, c1[i], 16, None) for i, b in enumerate(t1)] + [
        ("t2", i, b.value, c2[i], 8, "ns") for i, b in enumerate(t2)]
    assert len(t1) == 2 and len(t2) == 5


@pytest.mark.parametrize(("line", "field"), [
    ({"prompt_tokens": 3}, "block_hashes"),
    ({"prompt_tokens": 4, "token_ids": [1, 2, 3]}, "token_ids"),
    ({"prompt_tokens": 2, "token_ids": [1, "2"]}, "token_ids"),
    ({"prompt_tokens": 2, "token_ids": [1, 2], "hash_algo": "xxhash"}, "hash_algo"),
])
def test_gateway_bad_token_lines_refused(tmp_path: Path, write_jsonl: Callable[..., Path],
                                         line: dict[str, object], field: str) -> None:
    path = write_jsonl("gw.jsonl", [{"request_id": "t1", "arrival_ns": 1, **line}])
    with pytest.raises(InputError) as info:
        import_files("gateway", [path], tmp_path / "lake")
    msg = str(info.value)
    assert f"field {field!r}" in msg
    assert str(path) in msg and "line 1" in msg


# -- Bad lines --------------------------------------------------------------------------------

GOOD = {"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}
BAD_LINES = {
    "json": ('{"timestamp": 7, "input_length": ', None),
    "type": ('{"timestamp": 7, "input_length": "600", "output_length": 1, "hash_ids": [1, 2]}',
             "input_length"),
    "count": ('{"timestamp": 7, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}',
              "hash_ids"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
@pytest.mark.usefixtures("tiny_segments")
def test_bad_line_refused_and_scenario_untouched(tmp_path: Path, mooncake3: Path,
                                                 write_jsonl: Callable[..., Path], kind: str) -> None:
    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake, scenario="s")
    before_req, before_blocks = _requests(lake), _blocks(lake)
    before_files = _table_files(lake)
    assert len(before_req) == 3 and len(before_blocks) == 8

    line, field = BAD_LINES[kind]
    bad = write_jsonl("bad.jsonl", [GOOD, GOOD, line, GOOD])
    with pytest.raises(InputError) as info:
        import_files("mooncake", [bad], lake, scenario="s")
    msg = str(info.value)
    assert str(bad) in msg and "line 3" in msg
    assert info.value.line == 3
    if field is not None:
        assert repr(field) in msg and info.value.field == field
    assert "\n" not in msg

    assert _requests(lake) == before_req
    assert _blocks(lake) == before_blocks
    assert _table_files(lake) == before_files
    _assert_committed_layout_only(lake)
    assert _staged(lake) == []  # the aborted import removed what it had staged


@pytest.mark.usefixtures("tiny_segments")
def test_skip_bad_lines_counts_and_keeps_good(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    lines = [GOOD, BAD_LINES["json"][0], GOOD, BAD_LINES["type"][0], "", BAD_LINES["count"][0], GOOD]
    path = write_jsonl("mixed.jsonl", lines)
    lake = tmp_path / "lake"
    result = import_files("mooncake", [path], lake, scenario="s", skip_bad_lines=True)
    assert (result.requests, result.blocks, result.bad_lines) == (3, 6, 3)
    assert len(result.first_bad) == 3 and all(str(path) in b for b in result.first_bad)
    assert [r[0] for r in _requests(lake)] == ["mixed:0000001", "mixed:0000003", "mixed:0000007"]
    assert len(_blocks(lake)) == 6
    _assert_committed_layout_only(lake)


@pytest.mark.parametrize("skip", [False, True], ids=["refuse", "skip"])
def test_out_of_range_integer_is_a_bad_line(tmp_path: Path, write_jsonl: Callable[..., Path],
                                            skip: bool) -> None:
    path = write_jsonl("huge.jsonl", [GOOD, {**GOOD, "output_length": 3_000_000_000}, GOOD])
    if not skip:
        with pytest.raises(InputError) as info:
            import_files("mooncake", [path], tmp_path / "lake")
        assert "line 2" in str(info.value) and "output_length" in str(info.value)
    else:
        result = import_files("mooncake", [path], tmp_path / "lake", skip_bad_lines=True)
        assert (result.requests, result.bad_lines) == (2, 1)


@pytest.mark.parametrize("damage", ["truncated", "not_gzip"])
def test_damaged_gzip_is_an_input_error(tmp_path: Path, mooncake3: Path, damage: str) -> None:
    data = gzip.compress(mooncake3.read_bytes() * 50)
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"plain text, not gzip\n")
    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake)
    before = _requests(lake)
    with pytest.raises(InputError) as info:
        import_files("mooncake", [path], lake)
    assert str(path) in str(info.value)
    assert _requests(lake) == before


# -- Replace semantics ------------------------------------------------------------------------


def test_reimport_replaces_and_scenarios_coexist(tmp_path: Path, mooncake3: Path,
                                                 write_jsonl: Callable[..., Path]) -> None:
    lake = tmp_path / "lake"
    counts = "SELECT scenario, count(*) FROM {} GROUP BY 1 ORDER BY 1"
    import_files("mooncake", [mooncake3], lake, scenario="a")
    first = _requests(lake), _blocks(lake)
    import_files("mooncake", [mooncake3], lake, scenario="a")
    assert (_requests(lake), _blocks(lake)) == first
    assert _query(lake, counts.format("requests")) == [("a", 3)]
    assert _query(lake, counts.format("request_blocks")) == [("a", 8)]

    import_files("mooncake", [mooncake3], lake, scenario="b")
    assert _query(lake, counts.format("requests")) == [("a", 3), ("b", 3)]
    assert _query(lake, counts.format("request_blocks")) == [("a", 8), ("b", 8)]

    # A replacement with less data shrinks the scenario: nothing of the old one is left over.
    one = write_jsonl("one.jsonl", [GOOD])
    import_files("mooncake", [one], lake, scenario="a")
    assert _query(lake, counts.format("requests")) == [("a", 1), ("b", 3)]
    assert _query(lake, counts.format("request_blocks")) == [("a", 2), ("b", 8)]
    _assert_committed_layout_only(lake)


# -- Kill mid-way ----------------------------------------------------------------------------

_CHILD = """
import functools, sys
import kvlens.collector.importer as m
from kvlens.lake import SegmentWriter
m._BATCH_REQUESTS = 500
m.SegmentWriter = functools.partial(SegmentWriter, flush_rows=2000)
m.import_files("mooncake", [sys.argv[1]], sys.argv[2], scenario="s")
print("finished", flush=True)
"""


def test_kill_midway_leaves_previous_scenario(tmp_path: Path, mooncake3: Path) -> None:
    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake, scenario="s")
    before_req, before_blocks = _requests(lake), _blocks(lake)

    big = tmp_path / "big.jsonl"
    n = 150_000
    with open(big, "w") as f:
        f.write("".join(f'{{"timestamp": {i}, "input_length": 2000, "output_length": 1, '
                        f'"hash_ids": [{4 * i}, {4 * i + 1}, {4 * i + 2}, {4 * i + 3}]}}\n'
                        for i in range(n)))

    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(big), str(lake)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # Kill once staging holds a few segments (certainly mid-import); the deadline only bounds
        # a failure (a busy machine may take long to start the child).
        deadline = time.monotonic() + 180.0
        while child.poll() is None and len(list((lake / ".staging").glob("*/*/*/*/*.parquet"))) < 4:
            assert time.monotonic() < deadline, "the import staged nothing in time"
            time.sleep(0.01)
        still_running = child.poll() is None
        child.send_signal(signal.SIGKILL)
        out, err = child.communicate(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert still_running, f"the import finished before the kill: {out!r} {err[-2000:]!r}"
    assert child.returncode == -signal.SIGKILL
    assert _staged(lake), "expected staged segments from the killed run"

    for p in _table_files(lake):
        if p.suffix == ".parquet":
            pq.read_table(p)  # every visible segment is whole
    _assert_committed_layout_only(lake)
    assert _requests(lake) == before_req
    assert _blocks(lake) == before_blocks
    orphans = _query(lake, "SELECT count(*) FROM request_blocks WHERE request_id NOT IN "
                           "(SELECT request_id FROM requests)")
    assert orphans == [(0,)]


def test_error_between_table_commits_is_undone(tmp_path: Path, mooncake3: Path,
                                               write_jsonl: Callable[..., Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import kvlens.commit as commit_mod

    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake, scenario="s")
    before = _requests(lake), _blocks(lake)

    real_swap = commit_mod._swap_one
    calls: list[object] = []

    def swap_then_die(entry: dict[str, object]) -> None:
        calls.append(entry)
        if len(calls) == 2:  # interrupted before the second table's swap
            raise KeyboardInterrupt("simulated interrupt")
        real_swap(entry)

    monkeypatch.setattr(commit_mod, "_swap_one", swap_then_die)
    other = write_jsonl("other.jsonl", [GOOD])
    with pytest.raises(KeyboardInterrupt):
        import_files("mooncake", [other], lake, scenario="s")
    assert (_requests(lake), _blocks(lake)) == before
    assert not list((lake / ".journal").glob("*.json"))


_KILL_BETWEEN_SWAPS = """
import os, sys
import kvlens.commit as c
from kvlens.collector.importer import import_files
real, calls = c._swap_one, []
def swap(entry):
    calls.append(entry)
    if len(calls) == 2:
        os._exit(9)  # dies like kill -9: no handler, no cleanup
    real(entry)
c._swap_one = swap
import_files("mooncake", [sys.argv[1]], sys.argv[2], scenario="s")
"""


def test_kill_between_table_commits_is_undone_by_the_next_reader(
        tmp_path: Path, mooncake3: Path, write_jsonl: Callable[..., Path]) -> None:
    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake, scenario="s")
    before = _requests(lake), _blocks(lake)
    other = write_jsonl("other.jsonl", [GOOD])
    child = subprocess.run([sys.executable, "-c", _KILL_BETWEEN_SWAPS, str(other), str(lake)], cwd=REPO,
                           timeout=120)
    assert child.returncode == 9
    assert list((lake / ".journal").glob("*.json")), "the dead commit left its journal"
    assert (_requests(lake), _blocks(lake)) == before  # open_lake undid it
    assert not list((lake / ".journal").glob("*.json"))
    assert not [p for p in (lake / ".staging").glob("*")]  # the dead import's staging is gone
    import_files("mooncake", [other], lake, scenario="s")  # and the lake takes the next import
    assert len(_requests(lake)) == 1


# -- Gzip and progress ------------------------------------------------------------------------


def test_gzip_imports_like_plain(tmp_path: Path, mooncake3: Path) -> None:
    gz = tmp_path / "gz" / "trace.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(mooncake3.read_bytes()))
    lake = tmp_path / "lake"
    import_files("mooncake", [mooncake3], lake, scenario="plain")
    import_files("mooncake", [gz], lake, scenario="gz")

    def strip(rows: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
        return [(r[0], *r[2:]) for r in rows]

    assert len(_requests(lake, "gz")) == 3
    assert strip(_requests(lake, "gz")) == strip(_requests(lake, "plain"))
    assert strip(_blocks(lake, "gz")) == strip(_blocks(lake, "plain"))


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
def test_progress_sums_to_file_size(tmp_path: Path, compressed: bool) -> None:
    lines = b"".join(
        b'{"timestamp": %d, "input_length": 1024, "output_length": 1, "hash_ids": [%d, %d]}\n'
        % (i, 2 * i, 2 * i + 1) for i in range(20_000)
    )
    path = tmp_path / ("t.jsonl.gz" if compressed else "t.jsonl")
    path.write_bytes(gzip.compress(lines) if compressed else lines)
    steps: list[int] = []
    result = import_files("mooncake", [path], tmp_path / "lake", on_progress=steps.append)
    assert result.requests == 20_000
    assert len(steps) > 1
    assert all(s > 0 for s in steps)
    assert sum(steps) == os.path.getsize(path)


# -- values their rows cannot hold (issue 19, item 5) -------------------------------------------

POISON_LINES = [
    '{"request_id": "a", "arrival_ns": 1, "prompt_tokens": 16, "block_hashes": ["-1"]}',  # int("-1", 16)
    '{"request_id": "b", "arrival_s": 1e300, "prompt_tokens": 16, "block_hashes": [1]}',  # past int64 ns
    '{"request_id": "c", "arrival_ns": 1, "prompt_tokens": 16, "ttft_ms": 1e999, "block_hashes": [1]}',
    "[" * 5000 + "]" * 5000,  # nesting past the recursion limit
    '{"request_id": "d", "arrival_ns": 1, "prompt_tokens": 16, "block_hashes": [2]}',  # the good one
]


def test_poison_lines_are_bad_lines_through_the_cli(tmp_path: Path, write_jsonl: Callable[..., Path]) -> None:
    from click.testing import CliRunner

    from kvlens.cli import cli

    path = write_jsonl("gw.jsonl", POISON_LINES)
    lake = tmp_path / "lake"
    args = ["import", "gateway", str(path), "--lake", str(lake), "--scenario", "gw"]
    refused = CliRunner().invoke(cli, args)
    assert refused.exit_code == 1 and "Error:" in refused.output and "line 1" in refused.output
    skipped = CliRunner().invoke(cli, [*args, "--skip-bad-lines"])
    assert skipped.exit_code == 0, skipped.output
    assert "skipped 4 bad lines" in skipped.output
    assert query("SELECT request_id FROM requests", lake=lake)[1] == [("d",)]
    assert query("SELECT block_hash FROM request_blocks", lake=lake)[1] == [(2,)]


def test_bailian_infinite_timestamp_is_a_bad_line(write_jsonl: Callable[..., Path], tmp_path: Path) -> None:
    path = write_jsonl("b.jsonl", ['{"chat_id": 1, "timestamp": 1e308, "input_length": 16, '
                                   '"output_length": 1, "hash_ids": [1]}'])
    with pytest.raises(InputError, match="timestamp"):
        import_files("bailian", [path], tmp_path / "lake")


def test_a_line_past_the_length_limit_is_a_bad_line(write_jsonl: Callable[..., Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 MiB in earnest: only the limit is smaller, for the reader (which cuts the line) and the decoder
    monkeypatch.setattr(fields, "MAX_LINE_BYTES", 200)
    monkeypatch.setattr(importer, "MAX_LINE_BYTES", 200)
    good = '{"request_id": "g", "arrival_ns": 1, "prompt_tokens": 16, "block_hashes": [3]}'
    long = '{"request_id": "x", "arrival_ns": 1, "prompt_tokens": 16, "block_hashes": [' + "1, " * 400 + "1]}"
    path = write_jsonl("long.jsonl", [long, good])
    result = import_files("gateway", [path], tmp_path / "lake", skip_bad_lines=True)
    assert (result.requests, result.bad_lines) == (1, 1)
    assert "longer than the limit" in result.first_bad[0]
