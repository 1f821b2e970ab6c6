"""Benchmark: the demo's three 8-replica what-ifs on the vLLM engine, against the LRU engine (issue 15).

The Mooncake conversation trace (12,031 requests) is simulated under round robin, cache-aware
and cache-aware with the 2x load fallback, as ``kvlens demo`` does (sample_data/demo.py:
vLLM's block pool and continuous batching, every step priced). The baseline, measured in the
same run, is the simulator before it (``--engine lru``) on the what-ifs the demo ran then (8
replicas, 3M tokens of cache and 4 service slots each, a 1.5x fallback). One warm-up run on a
few requests first, so numba's compile (once per install, about a minute) or its cache load is
not timed. Each figure is the whole ``simulate`` call: preparing the arrays, the fleet, and the
lake frames.

Target (issue 15): the three vLLM what-ifs under 30 s together on this machine.
"""

from __future__ import annotations

import time

import duckdb
import polars as pl

from kvlens.analyzers.simulate import Engine, SimConfig, simulate
from kvlens.collector.importer import import_files
from kvlens.lake import open_lake
from kvlens.models import get_model
from kvlens.sample_data.demo import DEMO_MODEL, DEMO_SCENARIO, SAMPLE_TRACE, WHAT_IFS
from kvlens.schema import RoutingPolicy

TARGET_S = 30.0
_OLD = {"replicas": 8, "capacity_tokens": 3_000_000, "max_seqs": 4, "engine": Engine.LRU}
BASELINE = {
    "rr8": SimConfig(routing=RoutingPolicy.ROUND_ROBIN, **_OLD),  # type: ignore[arg-type]
    "cache8": SimConfig(routing=RoutingPolicy.CACHE_AWARE, **_OLD),  # type: ignore[arg-type]
    "cache8-lf1.5": SimConfig(routing=RoutingPolicy.CACHE_AWARE, load_factor=1.5,
                              **_OLD),  # type: ignore[arg-type]
}


def _trace(tmp: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    lake = f"{tmp}/lake"
    import_files("mooncake", [SAMPLE_TRACE], lake, scenario=DEMO_SCENARIO, model=DEMO_MODEL)
    con = duckdb.connect()
    open_lake(con, lake)
    reqs = con.sql("SELECT * FROM requests WHERE scenario = ?", params=[DEMO_SCENARIO]).pl()
    blocks = con.sql("SELECT * FROM request_blocks WHERE scenario = ?", params=[DEMO_SCENARIO]).pl()
    con.close()
    return reqs, blocks


def _timed(configs: dict[str, SimConfig], reqs: pl.DataFrame, blocks: pl.DataFrame) -> dict[str, float]:
    model = get_model(DEMO_MODEL)
    out = {}
    for name, config in configs.items():
        t0 = time.perf_counter()
        result = simulate(requests=reqs, request_blocks=blocks, config=config, model=model)
        out[name] = time.perf_counter() - t0
        hit = result.hit_tokens / int(reqs["prompt_tokens"].sum())
        print(f"   {name:<13} {config.engine:<5} {out[name]:6.1f} s  hit {hit:.1%}", flush=True)
    return out


def main() -> bool:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        reqs, blocks = _trace(tmp)
        first = reqs.sort("arrival_ns").head(200)
        t0 = time.perf_counter()
        simulate(requests=first, request_blocks=blocks, config=WHAT_IFS["cache8"],
                 model=get_model(DEMO_MODEL))
        print(f"   warm-up (compile or cache load): {time.perf_counter() - t0:.1f} s")
        vllm = _timed(WHAT_IFS, reqs, blocks)
        lru = _timed(BASELINE, reqs, blocks)
    total, base = sum(vllm.values()), sum(lru.values())
    print(f"   three what-ifs: vllm engine {total:.1f} s, lru engine (baseline) {base:.1f} s, "
          f"ratio {total / base:.2f}x; target under {TARGET_S:.0f} s")
    return total < TARGET_S
