"""A hand-built analysis DB spanning two days: a measured scenario whose hit ratio fell, and a what-if.

``prod`` (measured, model llama-3.1-8b) and ``prod-cache`` (a simulated what-if of the same
requests). Blocks of 100 tokens; day 0 is 2025-01-01, day 1 the day after:

    day  request  replica    blocks of prod                              prompt  tail
    0    r1       replica-0  hit_local, miss_cold                          250     50
    0    r2       replica-1  hit_local, hit_local, miss_evicted            300      0
    1    r3       replica-0  hit_local, miss_routing                       200      0
    1    r4       replica-1  miss_evicted, miss_evicted, hit_local,        450     50
                             miss_cold

So prod's token hit ratio is 300/550 on day 0 and 200/650 on day 1: -23.776 points. By part
(points of the hit ratio, -(share now - share before) x 100):

    miss_evicted replica-1  -(200/650 - 100/550)   miss_routing replica-0  -(100/650 - 0)
    miss_cold replica-0     -(0 - 100/550)         miss_cold replica-1     -(100/650 - 0)
    partial tail            -(50/650 - 50/550)

Day 1's avoidable tokens are 300 (miss_routing 100 on replica-0, miss_evicted 200 on replica-1).
In ``prod-cache`` every miss_routing and miss_evicted block of day 1 is a hit_local: 300 more hit
tokens on the same two requests.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from kvlens.lake import create_enum_types
from kvlens.schema import ANALYSIS_TABLES

__all__ = ["DAY0_NS", "DAY1_NS", "DAY_NS", "make_two_day_db"]

DAY_NS = 86_400 * 10**9
DAY0_NS = 1_735_689_600 * 10**9  # 2025-01-01T00:00:00Z
DAY1_NS = DAY0_NS + DAY_NS
MODEL = "llama-3.1-8b"

_PROD = [  # request, replica, arrival, outcomes of its full blocks, prompt, tail, ttft
    ("r1", "replica-0", DAY0_NS + 3600 * 10**9, ("hit_local", "miss_cold"), 250, 50, 100.0),
    ("r2", "replica-1", DAY0_NS + 7200 * 10**9, ("hit_local", "hit_local", "miss_evicted"), 300, 0, 120.0),
    ("r3", "replica-0", DAY1_NS + 3600 * 10**9, ("hit_local", "miss_routing"), 200, 0, 150.0),
    ("r4", "replica-1", DAY1_NS + 7200 * 10**9, ("miss_evicted", "miss_evicted", "hit_local", "miss_cold"),
     450, 50, 400.0),
]
_HITS = ("hit_local", "hit_offload", "hit_remote")


def _what_if(outcome: str, arrival: int) -> str:
    return "hit_local" if arrival >= DAY1_NS and outcome in ("miss_routing", "miss_evicted") else outcome


def make_two_day_db(path: Path) -> Path:
    """Write the DB described in the module docstring at ``path``."""
    con = duckdb.connect(str(path))
    create_enum_types(con)
    for table in ANALYSIS_TABLES:
        con.execute(f"CREATE TABLE {table.name} ({', '.join(f'{c.name} {c.type}' for c in table.columns)})")
    for s, provenance, ttft, assumed in (("prod", "measured", "measured", None),
                                         ("prod-cache", "simulated", "modelled", "a cache-aware what-if")):
        con.execute("INSERT INTO scenarios (scenario, model, kv_bytes_per_token, requests, needed_blocks, "
                    "analyzed_ns, model_source, provenance, sources, ttft_label, assumptions) "
                    "VALUES (?, ?, 131072, 4, 11, 0, 'given', ?, 'gateway', ?, ?)",
                    [s, MODEL, provenance, ttft, assumed])
    for scenario, change in (("prod", lambda o, _a: o), ("prod-cache", _what_if)):
        for request, replica, arrival, outcomes, prompt, tail, ttft in _PROD:
            got = [change(o, arrival) for o in outcomes]
            con.executemany(
                "INSERT INTO block_outcomes (scenario, request_id, replica, arrival_ns, position, "
                "block_hash, outcome, tokens, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, 100, 13107200)",
                [(scenario, request, replica, arrival, i, 1000 + i, o) for i, o in enumerate(got)])
            hit = 100 * sum(o in _HITS for o in got)
            con.execute(
                "INSERT INTO request_ledger (scenario, replica, request_id, arrival_ns, prompt_tokens, "
                "hit_tokens, recomputed_last_tokens, miss_tokens, tail_partial_tokens, unobserved_tokens, "
                "ttft_ms) VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, 0, ?)",
                [scenario, replica, request, arrival, prompt, hit, prompt - tail - hit, tail,
                 ttft * (0.5 if scenario == "prod-cache" and arrival >= DAY1_NS else 1.0)])
    con.execute("INSERT INTO miss_ledger SELECT scenario, replica, outcome, count(*), sum(tokens), "
                "sum(bytes) FROM block_outcomes GROUP BY ALL")
    con.close()
    return path
