"""Benchmark: the miss ledger's replay core and ``kvlens analyze`` on a simulated 8-replica scenario.

The Mooncake conversation trace (12,031 requests, 288,500 blocks) is simulated on 8 replicas
under round_robin; the arrays ``block_outcomes`` hands to the compiled ``replay_core`` are
captured and replayed again, after one warm-up call (so numba's compile or cache load is not
timed). The baseline is the plain-Python dictionary replay (tests/replay_oracle.py) measured in
the same run on the same arrays. Its miss-cause scan walks the whole residency set per miss, so
a full stream would take hours: it runs on the first ORACLE_REQUESTS requests, and the core is
timed on that same prefix too, for a like-for-like ratio (the outputs are checked equal).

Targets (issue 3): the core >= 1,000,000 block look-ups/s on the full stream; ``kvlens analyze``
(in process, the core already compiled) on the scenario under 30 s.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
from click.testing import CliRunner

import analyzers.outcomes as outcomes_mod
from analyzers.simulate import SimConfig, simulate
from collector.importer import import_files
from kvlens.cli import cli
from kvlens.lake import open_lake, write_scenario
from kvlens.models import get_model
from sample_data import MOONCAKE_CONVERSATION

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replay_oracle import replay_py

TARGET_LOOKUPS_PER_S = 1_000_000
TARGET_ANALYZE_S = 30.0
ORACLE_REQUESTS = int(os.environ.get("KVLENS_BENCH_ORACLE_REQUESTS", 300))
MODEL = "llama-3.1-70b"


def _lake(root: Path) -> Path:
    lake = root / "lake"
    import_files("mooncake", [MOONCAKE_CONVERSATION], lake, scenario="conv", model=MODEL)
    con = duckdb.connect()
    open_lake(con, lake)
    reqs = con.sql("SELECT * FROM requests WHERE scenario = 'conv'").pl()
    blocks = con.sql("SELECT * FROM request_blocks WHERE scenario = 'conv'").pl()
    con.close()
    sim = simulate(requests=reqs, request_blocks=blocks, config=SimConfig(replicas=8), model=get_model(MODEL))
    write_scenario(lake, "rr8", {k: v.to_arrow() for k, v in sim.tables.items()}, writer_id="simulate")
    return lake


def _capture(lake: Path) -> tuple[Any, ...]:
    """The replay core's arguments for scenario rr8, as block_outcomes builds them (the warm-up)."""
    captured: list[tuple[Any, ...]] = []
    core = outcomes_mod.replay_core

    def recording(*args: Any) -> Any:
        captured.append(args)
        return core(*args)

    con = duckdb.connect()
    open_lake(con, lake)
    outcomes_mod.replay_core = recording  # type: ignore[assignment]
    try:
        outcomes_mod.block_outcomes(
            requests=con.table("requests"), request_blocks=con.table("request_blocks"),
            kv_events=con.table("kv_events"), transfers=con.table("transfers"), scenario="rr8",
            bytes_per_token=1)
    finally:
        outcomes_mod.replay_core = core
        con.close()
    return captured[0]


def dict_replay(ev_ts: Any, ev_kind: Any, ev_loc: Any, ev_tier: Any, ev_h: Any, ev_c: Any, ev_ns: Any,
                req_t: Any, req_loc: Any, req_tail: Any, req_off: Any, blk_h: Any, blk_c: Any, blk_ns: Any,
                blk_xfer: Any, n_locs: int) -> tuple[list[int], ...]:
    """The replay core's decisions with plain dicts: residency[h] = bit mask of 2*loc + tier."""
    ev = list(zip(ev_ts.tolist(), ev_kind.tolist(), ev_loc.tolist(), ev_tier.tolist(), ev_h.tolist(),
                  ev_c.tolist(), ev_ns.tolist(), strict=True))
    bh, bc, bn, bx = blk_h.tolist(), blk_c.tolist(), blk_ns.tolist(), blk_xfer.tolist()
    n = len(bh)
    out, holder, rem_ts, rem_loc, other = [-1] * n, [-1] * n, [-1] * n, [-1] * n, [-1] * n
    res: dict[int, int] = {}
    stored: set[int] = set()
    removed: dict[int, tuple[int, int]] = {}
    c_ns: dict[int, list[int]] = {}
    k = 0
    for i, t in enumerate(req_t.tolist()):
        while k < len(ev) and ev[k][0] < t:
            ts, kind, loc, tier, h, c, ns = ev[k]
            k += 1
            if kind == 2:
                sel = (3 << 2 * loc) if tier < 0 else (1 << 2 * loc + tier)
                for hh, m in list(res.items()):
                    if m & sel:
                        res[hh] = m & ~sel
                        removed[hh] = (ts, loc)
            elif kind == 0:
                res[h] = res.get(h, 0) | (1 << 2 * loc + tier)
                stored.add(h)
                if c and ns != -1 and ns not in c_ns.setdefault(c, []):
                    c_ns[c].append(ns)
            elif res.get(h, 0) & (1 << 2 * loc + tier):
                res[h] &= ~(1 << 2 * loc + tier)
                removed[h] = (ts, loc)
        r = int(req_loc[i])
        chain = True
        for j in range(int(req_off[i]), int(req_off[i + 1])):
            m = res.get(bh[j], 0)
            gpu, low, x = m >> 2 * r & 1, m >> 2 * r + 1 & 1, bx[j]
            if chain and (gpu or low or x == 1):
                out[j] = 0 if gpu else 1 if low else 2
                continue
            chain = False
            if x == 2:
                out[j] = 4
            elif gpu or low or x == 1:
                out[j] = 5
            elif m & ~(3 << 2 * r):
                rest = m & ~(3 << 2 * r)
                out[j], holder[j] = 6, ((rest & -rest).bit_length() - 1) // 2
            elif bh[j] in stored:
                out[j] = 7
                rem_ts[j], rem_loc[j] = removed.get(bh[j], (-1, -1))
            else:
                others = [v for v in c_ns.get(bc[j], []) if v != bn[j]] if bc[j] and bn[j] != -1 else []
                out[j], other[j] = (8, others[0]) if others else (9, -1)
        last = int(req_off[i + 1]) - 1
        if chain and not req_tail[i] and last >= int(req_off[i]):
            out[last] = 3
    return out, holder, rem_ts, rem_loc, other


def _prefix(args: tuple[Any, ...], n_req: int) -> tuple[Any, ...]:
    """The first ``n_req`` requests, their blocks, and the events before their last look-up."""
    ev, (req_t, req_loc, req_tail, req_off), blk, n_locs = args[:7], args[7:11], args[11:15], args[15]
    n_blk = int(req_off[n_req])
    n_ev = int(np.searchsorted(ev[0], req_t[n_req - 1], side="left"))
    return (*(a[:n_ev] for a in ev), req_t[:n_req], req_loc[:n_req], req_tail[:n_req], req_off[:n_req + 1],
            *(a[:n_blk] for a in blk), n_locs)


def _best_of(n: int, fn: Any, *args: Any) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> bool:
    core = outcomes_mod.replay_core
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        lake = _lake(Path(tmp))
        setup_s = time.perf_counter() - t0
        args = _capture(lake)
        n_blk, n_ev = len(args[11]), len(args[0])
        core_s, core_full = _best_of(3, core, *args)
        dict_s, dict_full = _best_of(1, dict_replay, *args)
        dict_agree = all(np.asarray(a).tolist() == list(b) for a, b in zip(core_full, dict_full, strict=True))
        small = _prefix(args, ORACLE_REQUESTS)
        n_small = len(small[11])
        core_small_s, core_small = _best_of(3, core, *small)
        oracle_s, oracle_small = _best_of(1, replay_py, *small)
        agree = all(np.asarray(a).tolist() == list(b) for a, b in zip(core_small, oracle_small, strict=True))
        runner = CliRunner()
        t0 = time.perf_counter()
        result = runner.invoke(cli, ["analyze", "--lake", str(lake), "--db", str(Path(tmp) / "kvlens.duckdb"),
                                     "--scenario", "rr8"])
        analyze_s = time.perf_counter() - t0
        analyzed = result.exit_code == 0
    rate = n_blk / core_s
    print(f"   scenario rr8: 8 replicas, round_robin; {n_blk:,} block look-ups, {n_ev:,} events "
          f"(import + simulate {setup_s:.1f} s)")
    print(f"   replay core, full stream      {rate:>12,.0f} look-ups/s  ({core_s:.3f} s, best of 3, "
          "after a warm-up call)")
    print(f"   plain-dict Python replay      {n_blk / dict_s:>12,.0f} look-ups/s  ({dict_s:.2f} s; "
          f"outputs {'equal' if dict_agree else 'DIFFER'})")
    print(f"   core / plain-dict speed       {dict_s / core_s:>12.1f}x")
    print(f"   replay core, first {ORACLE_REQUESTS} requests {n_small / core_small_s:>11,.0f} look-ups/s  "
          f"({n_small:,} look-ups, {core_small_s * 1e3:.1f} ms)")
    print(f"   Python oracle, same prefix    {n_small / oracle_s:>12,.0f} look-ups/s  ({oracle_s:.2f} s; "
          f"outputs {'equal' if agree else 'DIFFER'})")
    print(f"   core / oracle speed (prefix)  {oracle_s / core_small_s:>12,.0f}x")
    print(f"   kvlens analyze (in process)   {analyze_s:>12.2f} s  (target < {TARGET_ANALYZE_S:.0f} s"
          f"{'' if analyzed else '; FAILED: ' + result.output.strip()})")
    return analyzed and agree and dict_agree and rate >= TARGET_LOOKUPS_PER_S and analyze_s < TARGET_ANALYZE_S


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
