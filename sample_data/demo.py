"""Sample data: the demo pipeline, from the shipped trace to a summary an operator can read."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import polars as pl

from kvlens.analysis_db import build_analysis_db
from kvlens.analyzers import analyze_scenario
from kvlens.analyzers.costs import DeviceModel
from kvlens.analyzers.simulate import SimConfig, SimResult
from kvlens.analyzers.what_if import simulate_scenario
from kvlens.collector import import_files
from kvlens.lake import open_lake
from kvlens.models import get_model
from kvlens.sample_data import MOONCAKE_CONVERSATION
from kvlens.sample_data.agents import AGENT_MODEL, write_agent_log
from kvlens.schema import RoutingPolicy

__all__ = ["DEMO_MODEL", "DEMO_SCENARIO", "INFINITE_CACHE_SQL", "SAMPLE_TRACE", "WHAT_IFS", "run_demo"]

SAMPLE_TRACE = MOONCAKE_CONVERSATION
DEMO_SCENARIO = "conversation"
# The Mooncake paper serves this workload with LLaMA3-70B (320 KiB of KV per token).
DEMO_MODEL = "llama-3.1-70b"

# With an unbounded cache, a full block is reusable when its key was needed by an earlier
# request (arrival order, ties by request id); partial tails are always recomputed.
INFINITE_CACHE_SQL = """
WITH ordered AS (
    SELECT block_tokens, block_size_tokens, block_hash,
           row_number() OVER (PARTITION BY block_hash ORDER BY arrival_ns, request_id) AS nth
    FROM request_blocks WHERE scenario = $scenario
), blocks AS (
    SELECT count(*) AS blocks, count(DISTINCT block_hash) AS distinct_blocks,
           coalesce(sum(block_tokens) FILTER (WHERE nth > 1 AND block_tokens = block_size_tokens), 0)
               AS reusable_tokens
    FROM ordered
), reqs AS (
    SELECT count(*) AS requests, sum(prompt_tokens) AS prompt_tokens
    FROM requests WHERE scenario = $scenario
)
SELECT requests, prompt_tokens, blocks, distinct_blocks, reusable_tokens,
       reusable_tokens / prompt_tokens AS reusable_ratio
FROM reqs, blocks
"""


# 8 vLLM replicas of Llama-3.1-70B on 4 H100s each (TP4): 320 GB of HBM less 140 GB of weights
# leaves about 500k tokens of KV (320 KiB each), vLLM's H100 defaults otherwise (8,192 tokens a
# step, 1,024 sequences). At the trace's own rate, round robin queues there.
DEMO_DEVICE = DeviceModel(name="4x H100-SXM, TP4 (modelled)", gpus_per_replica=4)
_FLEET = {"replicas": 8, "capacity_tokens": 500_000, "device": DEMO_DEVICE}
WHAT_IFS: dict[str, SimConfig] = {
    "rr8": SimConfig(routing=RoutingPolicy.ROUND_ROBIN, **_FLEET),  # type: ignore[arg-type]
    "cache8": SimConfig(routing=RoutingPolicy.CACHE_AWARE, **_FLEET),  # type: ignore[arg-type]
    "cache8-lf2": SimConfig(routing=RoutingPolicy.CACHE_AWARE, load_factor=2.0,
                            **_FLEET),  # type: ignore[arg-type]
}

LEDGER_SIDE_BY_SIDE_SQL = """
SELECT l.scenario,
       sum(tokens) FILTER (WHERE outcome IN ('hit_local', 'hit_offload', 'hit_remote')) / p.prompt
           AS hit_ratio,
       sum(tokens) FILTER (WHERE outcome = 'miss_routing') / p.prompt AS routing_share,
       sum(tokens) FILTER (WHERE outcome = 'miss_evicted') / p.prompt AS evicted_share,
       sum(tokens) FILTER (WHERE outcome = 'miss_cold') / p.prompt AS cold_share,
       sum(bytes) FILTER (WHERE outcome IN ('hit_local', 'hit_offload', 'hit_remote')) AS hit_bytes,
       any_value(p.p50) AS ttft_p50_ms, any_value(p.p99) AS ttft_p99_ms
FROM miss_ledger l JOIN (
    SELECT scenario, sum(prompt_tokens) AS prompt, median(ttft_ms) AS p50,
           quantile_cont(ttft_ms, 0.99) AS p99
    FROM request_ledger GROUP BY scenario) p USING (scenario)
WHERE l.scenario IN (SELECT unnest($names))
GROUP BY l.scenario, p.prompt ORDER BY list_position($names, l.scenario)
"""


def _what_ifs(lake: Path) -> dict[str, SimResult]:
    return {name: simulate_scenario(lake, DEMO_SCENARIO, name, config, get_model(DEMO_MODEL),
                                    writer_id="demo").sim
            for name, config in WHAT_IFS.items()}


# The synthetic agent service (sample_data/agents.py): token ids and tenants, two planted faults,
# served by 4 replicas with a small GPU cache each and a shared pool.
AGENT_SCENARIO = "agents"
AGENT_WHAT_IF = "agents4-pool"
_AGENT_FLEET = SimConfig(routing=RoutingPolicy.CACHE_AWARE, replicas=4, capacity_tokens=60_000,
                         pool_tokens=400_000)


def _agents(workdir: Path, lake: Path) -> None:
    log = write_agent_log(workdir / "agents_gateway.jsonl")
    import_files("gateway", [log], lake, scenario=AGENT_SCENARIO, model=AGENT_MODEL)
    simulate_scenario(lake, AGENT_SCENARIO, AGENT_WHAT_IF, _AGENT_FLEET, get_model(AGENT_MODEL),
                      writer_id="demo")


AGENT_FINDINGS_SQL = """
SELECT (SELECT count(*) FROM hygiene WHERE scenario = $s) AS hygiene_requests,
       (SELECT coalesce(sum(lost_tokens), 0) FROM hygiene WHERE scenario = $s) AS lost_tokens,
       (SELECT sum(hit_tokens) / sum(prompt_tokens) FROM request_ledger WHERE scenario = $s) AS hit_ratio,
       (SELECT coalesce(sum(read_bytes), 0) FROM flows WHERE scenario = $s AND tier = 'pool')
           AS pool_read_bytes
"""


def _agent_lines(db: Path) -> list[str]:
    con = duckdb.connect(str(db), read_only=True)
    row = con.execute(AGENT_FINDINGS_SQL, {"s": AGENT_WHAT_IF}).fetchone()
    findings = con.execute("SELECT severity, detail FROM isolation_findings WHERE scenario = ? "
                           "ORDER BY blocks DESC LIMIT 2", [AGENT_WHAT_IF]).fetchall()
    con.close()
    assert row is not None
    requests, lost, hit, pool_read = row
    lines = ["", "Synthetic agent service (sample_data/agents.py, planted faults), "
                 f"scenario {AGENT_WHAT_IF!r}:",
             f"  hit ratio {hit or 0:.1%} of prompt tokens; "
             f"{pool_read / 2**30:.1f} GiB loaded from the pool",
             f"  prompt hygiene: {requests:,} requests split early before repeated content, "
             f"{lost:,} tokens lost"]
    lines += [f"  isolation ({severity}): {detail}" for severity, detail in findings]
    return lines


def _side_by_side(db: Path, results: dict[str, SimResult]) -> list[str]:
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(LEDGER_SIDE_BY_SIDE_SQL, {"names": list(WHAT_IFS)}).fetchall()
    con.close()
    lines = [f"  {'scenario':<12}{'hit ratio':>10}{'routing':>9}{'evicted':>9}{'cold':>7}"
             f"{'hit KV':>11}{'TTFT p50':>10}{'p99':>10}  (TTFT modelled)"]
    by_name = {}
    for name, hit, routing, evicted, cold, hit_bytes, p50, p99 in rows:
        by_name[name] = (hit or 0.0, p99)
        lines.append(f"  {name:<12}{hit or 0:>10.1%}{routing or 0:>9.1%}{evicted or 0:>9.1%}{cold or 0:>7.1%}"
                     f"{(hit_bytes or 0) / 2**40:>7.2f} TiB{p50 / 1e3:>8.2f} s{p99 / 1e3:>8.1f} s")
    return lines + _sentences(by_name, results)


def _sentences(by_name: dict[str, tuple[float, float]], results: dict[str, SimResult]) -> list[str]:
    """One sentence per what-if, from its numbers (every time modelled)."""
    (rr, rr_p99), (ca, ca_p99), (lf, lf_p99) = (by_name[n] for n in WHAT_IFS)
    queue = {n: float(r.tables["requests"]["queue_ms"].quantile(0.99) or 0) / 1e3 for n, r in results.items()}
    moved = results["cache8-lf2"].stats.get("fallbacks", 0)
    sentences = [
        f"rr8: round robin spreads each conversation's turns over all 8 replicas, so a turn seldom finds "
        f"its earlier turns' blocks ({rr:.1%} hit); recomputing them fills the queues (queue P99 "
        f"{queue['rr8']:.1f} s, TTFT P99 {rr_p99 / 1e3:.1f} s, modelled).",
        f"cache8: routing each request to the replica holding its longest prefix serves {ca:.1%} from "
        f"cache ({ca / rr if rr else 0:.1f}x round robin); less recompute, shorter queues (queue P99 "
        f"{queue['cache8']:.1f} s, TTFT P99 {ca_p99 / 1e3:.1f} s, modelled).",
        f"cache8-lf2: sending a request to the least loaded replica when its cache-aware choice holds "
        f"more than 2x the mean in-flight requests moved {moved:,} requests, for {(ca - lf) * 100:.1f} "
        f"points of hit ratio, TTFT P99 {lf_p99 / 1e3:.1f} s (modelled).",
    ]
    return [line for text in sentences
            for line in textwrap.wrap(text, 100, initial_indent="  ", subsequent_indent="    ")]


# The curve's ratios are over full blocks (the cache's stream); x full-block share = share of prompt.
CAPACITY_SQL = """
SELECT c.c_eff_bytes, c.hit_ratio_bytes_at_eff, c.hit_ratio_bytes_at_2x_eff,
       (SELECT max(hit_ratio_bytes) FROM mrc WHERE scenario = c.scenario AND method = 'exact') AS unbounded,
       (SELECT (sum(prompt_tokens) - sum(tail_partial_tokens)) / sum(prompt_tokens) FROM request_ledger
        WHERE scenario = c.scenario) AS full_share
FROM capacity c WHERE c.scenario = $scenario
"""


def _capacity(db: Path, fleet_tokens: int) -> list[str]:
    con = duckdb.connect(str(db), read_only=True)
    scenario = next(iter(WHAT_IFS))
    ((c_eff, at, at2, unbounded, full),) = con.execute(CAPACITY_SQL, {"scenario": scenario}).fetchall()
    con.close()
    return [
        "",
        "Capacity (modelled: an LRU of full-block slots on the exact miss-ratio curve): the fleet's "
        f"{fleet_tokens / 1e6:.0f}M tokens",
        f"  of cache ({c_eff / 2**40:.2f} TiB of KV; nothing measured to subtract, so C_eff = C_physical) "
        "as one shared LRU would serve",
        f"  {at * full:.1%} of prompt tokens; doubling it {at2 * full:.1%}, an unbounded cache "
        f"{unbounded * full:.1%} (the reusable share above).",
    ]


def run_demo(workdir: Path, *, on_progress: Callable[[int], None] | None = None) -> str:
    """Import the sample trace into ``workdir/lake`` and return the summary text."""
    workdir.mkdir(parents=True, exist_ok=True)
    lake = workdir / "lake"
    import_files("mooncake", [SAMPLE_TRACE], lake, scenario=DEMO_SCENARIO, model=DEMO_MODEL,
                 on_progress=on_progress)
    con = duckdb.connect()
    open_lake(con, lake)
    row = con.execute(INFINITE_CACHE_SQL, {"scenario": DEMO_SCENARIO}).fetchone()
    assert row is not None
    requests, prompt, blocks, distinct, reusable, ratio = row
    geo = get_model(DEMO_MODEL)
    con.close()
    per_token = geo.kv_bytes_per_token()
    results = _what_ifs(lake)
    _agents(workdir, lake)
    db = workdir / "kvlens.duckdb"
    fleet = next(iter(WHAT_IFS.values()))
    fleet_tokens = fleet.replicas * (fleet.capacity_tokens or 0)
    agent_tokens = _AGENT_FLEET.replicas * (_AGENT_FLEET.capacity_tokens or 0)

    def analyses(con: duckdb.DuckDBPyConnection) -> Iterator[tuple[str, pl.DataFrame]]:
        for name in WHAT_IFS:
            yield from analyze_scenario(con, name, geo, cache_tokens=fleet_tokens)
        yield from analyze_scenario(con, AGENT_WHAT_IF, get_model(AGENT_MODEL), cache_tokens=agent_tokens)

    build_analysis_db(db, lake, analyses)
    lines = [
        "",
        f"kvlens demo: Mooncake conversation trace as scenario {DEMO_SCENARIO!r} ({geo.name}, "
        f"{per_token:,} B of KV per token)",
        f"  requests              {requests:>14,}",
        f"  prompt tokens         {prompt:>14,}",
        f"  blocks needed         {blocks:>14,}  ({distinct:,} distinct, 512 tokens each)",
        f"  KV of distinct blocks {distinct * 512 * per_token / 2**40:>14.2f} TiB",
        f"  reusable with an unbounded cache: {reusable:,} tokens = {ratio:.1%} of prompt tokens",
        "    (a full block needed by an earlier request; partial tails counted as recomputed)",
        "",
        "What-ifs: the same requests on 8 vLLM replicas (4x H100 each, 500k tokens of KV each),",
        "simulated with vLLM's block pool and continuous batching; shares of prompt tokens by ledger",
        "outcome; TTFT modelled (a roofline of the device, analyzers/step_time.py):",
        *_side_by_side(db, results),
        *_capacity(db, fleet_tokens),
        *_agent_lines(db),
        "",
        f"lake:        {lake}",
        f"analysis DB: {db}",
        f"try:  kvlens sql --db {db} \"select scenario, outcome, sum(tokens) from miss_ledger group by all\"",
    ]
    return "\n".join(lines)
