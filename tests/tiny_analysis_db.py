"""A hand-built analysis DB for the report and export tests: two scenarios, two requests, known numbers.

Scenario ``a`` (measured, round robin) and ``b`` (a simulated what-if of the same requests, so its
figures are modelled), 10 KV bytes per token:

    request  arrival  replica (a / b)      blocks (100 tokens each)      prompt  tail
    r1       t0       replica-0 / replica-0  pos0 miss_cold / miss_cold    100     0
    r2       t0+10s   replica-1 / replica-0  pos0 miss_routing / hit_local 250     50
                                             pos1 miss_cold / miss_cold

So ``a`` hits 0 of 350 prompt tokens and ``b`` 100 (28.6%); in ``a``, miss_routing is 100 of 350
prompt tokens (28.6%), all on replica-1 (100 of its 250 = 40.0%), and ``b`` served all of them.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from kvlens.lake import create_enum_types
from kvlens.schema import ANALYSIS_TABLES

__all__ = ["T0_NS", "make_tiny_db", "mark_unobserved"]

T0_NS = 1_735_689_600 * 10**9  # 2025-01-01T00:00:00Z
_ASSUMED = "tiny simulator: TTFT = queue + prefill at a stated rate"
S = 10**9

_BLOCKS = [  # scenario, request, replica, arrival, position, hash, outcome, holder
    ("a", "r1", "replica-0", T0_NS, 0, 11, "miss_cold", None),
    ("a", "r2", "replica-1", T0_NS + 10 * S, 0, 11, "miss_routing", "replica-0"),
    ("a", "r2", "replica-1", T0_NS + 10 * S, 1, 22, "miss_cold", None),
    ("b", "r1", "replica-0", T0_NS, 0, 11, "miss_cold", None),
    ("b", "r2", "replica-0", T0_NS + 10 * S, 0, 11, "hit_local", None),
    ("b", "r2", "replica-0", T0_NS + 10 * S, 1, 22, "miss_cold", None),
]
_REQUESTS = [  # scenario, replica, request, arrival, prompt, hit, miss, tail, dominant, ttft
    ("a", "replica-0", "r1", T0_NS, 100, 0, 100, 0, "miss_cold", 100.0),
    ("a", "replica-1", "r2", T0_NS + 10 * S, 250, 0, 200, 50, "miss_routing", 300.0),
    ("b", "replica-0", "r1", T0_NS, 100, 0, 100, 0, "miss_cold", 100.0),
    ("b", "replica-0", "r2", T0_NS + 10 * S, 250, 100, 100, 50, "miss_cold", 200.0),
]


def make_tiny_db(path: Path) -> Path:
    """Write the DB described in the module docstring at ``path``."""
    con = duckdb.connect(str(path))
    create_enum_types(con)
    for table in ANALYSIS_TABLES:
        con.execute(f"CREATE TABLE {table.name} ({', '.join(f'{c.name} {c.type}' for c in table.columns)})")
    for s, provenance, ttft, source, assumed in (("a", "measured", "measured", "gateway", None),
                                                 ("b", "simulated", "modelled", "sim", _ASSUMED)):
        con.execute("INSERT INTO scenarios (scenario, model, kv_bytes_per_token, requests, needed_blocks, "
                    "analyzed_ns, model_source, provenance, sources, ttft_label, assumptions) "
                    "VALUES (?, 'tiny', 10, 2, 3, 0, 'given', ?, ?, ?, ?)",
                    [s, provenance, source, ttft, assumed])
    con.executemany("INSERT INTO block_outcomes (scenario, request_id, replica, arrival_ns, position, "
                    "block_hash, outcome, tokens, bytes, holder) VALUES (?, ?, ?, ?, ?, ?, ?, 100, 1000, ?)",
                    _BLOCKS)
    con.execute("INSERT INTO miss_ledger (scenario, replica, outcome, blocks, tokens, bytes) "
                "SELECT scenario, replica, outcome, count(*), sum(tokens), "
                "sum(bytes) FROM block_outcomes GROUP BY ALL")
    con.executemany("INSERT INTO request_ledger (scenario, replica, request_id, arrival_ns, prompt_tokens, "
                    "hit_tokens, recomputed_last_tokens, miss_tokens, tail_partial_tokens, dominant_miss, "
                    "ttft_ms) VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?)", _REQUESTS)
    con.close()
    return path


def mark_unobserved(path: Path, scenario: str, request_id: str, tokens: int) -> None:
    """Make ``tokens`` of a request's misses unobserved: it ran on a replica that published no KV events."""
    con = duckdb.connect(str(path))
    try:
        con.execute("UPDATE request_ledger SET unobserved_tokens = ?, miss_tokens = 0 "
                    "WHERE scenario = ? AND request_id = ?", [tokens, scenario, request_id])
    finally:
        con.close()
