"""Routing what-ifs on a synthetic multi-turn chat service (sample_data/multiturn.py), on the demo's fleet.

A chat's next turn repeats the whole conversation so far; whoever holds it can skip its
prefill. The model's answers, asserted: cache-aware routing more than doubles the hit ratio
over round robin and cuts the TTFT tail; the 2x load fallback costs little hit ratio but, on
this workload, raises the tail (the second test says why, with the numbers).
"""

from __future__ import annotations

from collections.abc import Iterator

import duckdb
import numpy as np
import polars as pl
import pytest

from kvlens.analyzers.simulate import SimResult, simulate
from kvlens.collector.importer import import_files
from kvlens.lake import open_lake
from kvlens.models import get_model
from kvlens.sample_data.demo import DEMO_MODEL, WHAT_IFS
from kvlens.sample_data.multiturn import write_multiturn_trace

pytestmark = pytest.mark.slow  # three 8-replica simulations of an 8,000-request trace


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimResult]]:
    tmp = tmp_path_factory.mktemp("multiturn")
    trace = write_multiturn_trace(tmp / "chat.jsonl")
    import_files("mooncake", [trace], tmp / "lake", scenario="chat", model=DEMO_MODEL)
    con = duckdb.connect()
    open_lake(con, tmp / "lake")
    reqs = con.sql("SELECT * FROM requests WHERE scenario = 'chat'").pl()
    blocks = con.sql("SELECT * FROM request_blocks WHERE scenario = 'chat'").pl()
    con.close()
    model = get_model(DEMO_MODEL)
    yield {name: simulate(requests=reqs, request_blocks=blocks, config=config, model=model)
           for name, config in WHAT_IFS.items()}


def _stats(sim: SimResult) -> tuple[float, float, float]:
    r = sim.tables["requests"]
    return (sim.hit_tokens / int(r["prompt_tokens"].sum()), float(np.percentile(r["ttft_ms"], 99)),
            float(np.percentile(r["queue_ms"], 99)))


def test_cache_aware_more_than_doubles_the_hits_and_cuts_the_tail(runs: dict[str, SimResult]) -> None:
    (rr, rr_p99, rr_q99), (ca, ca_p99, ca_q99), (lf, lf_p99, _q) = (_stats(runs[n]) for n in WHAT_IFS)
    print(f"\n   round robin: hit {rr:.1%}, TTFT P99 {rr_p99:,.0f} ms, queue P99 {rr_q99:,.0f} ms"
          f"\n   cache-aware: hit {ca:.1%}, TTFT P99 {ca_p99:,.0f} ms, queue P99 {ca_q99:,.0f} ms"
          f"\n   cache-aware + 2x fallback: hit {lf:.1%}, TTFT P99 {lf_p99:,.0f} ms (all times modelled)")
    assert runs["rr8"].tables["requests"].height > 7_000
    assert rr_q99 > 1_000  # round robin queues at this load
    assert ca > 2 * rr
    assert ca_p99 < rr_p99 / 2
    assert ca - lf <= 0.10


def test_the_fallback_raises_the_tail_where_cache_aware_barely_queues(runs: dict[str, SimResult]) -> None:
    # Cache-aware routing spreads the sessions (a new one goes to the least loaded replica), so
    # its queues stay short. The fallback then fires on small, momentary in-flight imbalances
    # and sends a turn away from the replica holding its conversation: that turn recomputes its
    # whole history, which takes longer than the queueing it avoided. Here the moved requests'
    # TTFT more than doubles while cache-aware's queue P99 is a fraction of their recompute,
    # and those requests make the fallback's P99.
    ca, lf = runs["cache8"], runs["cache8-lf2"]
    moved = lf.stats["moved"]
    assert lf.stats["fallbacks"] == len(moved) > 0
    ttft = {name: sim.tables["requests"].filter(pl.col("request_id").is_in(moved)).sort("request_id")
            for name, sim in (("ca", ca), ("lf", lf))}
    before, after = float(ttft["ca"]["ttft_ms"].mean()), float(ttft["lf"]["ttft_ms"].mean())
    lost = float((ttft["ca"]["cached_tokens"] - ttft["lf"]["cached_tokens"]).mean())
    (_h, ca_p99, ca_q99), (_h2, lf_p99, _q) = _stats(ca), _stats(lf)
    print(f"\n   the fallback moved {len(moved):,} requests: {lost:,.0f} fewer cached tokens each, "
          f"mean TTFT {before:,.0f} -> {after:,.0f} ms; cache-aware's queue P99 {ca_q99:,.0f} ms; "
          f"TTFT P99 {ca_p99:,.0f} -> {lf_p99:,.0f} ms (modelled)")
    assert after > 2 * before and lost > 5_000
    assert ca_q99 < after - before
    assert lf_p99 > ca_p99
