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

import kvlens.analyzers.outcomes as outcomes_mod
from kvlens.analyzers import scenario_rows
from kvlens.analyzers.replay import replay_core
from kvlens.analyzers.simulate import SimConfig, simulate
from kvlens.cli import cli
from kvlens.collector.importer import import_files
from kvlens.lake import open_lake, write_scenario
from kvlens.models import get_model
from kvlens.sample_data import MOONCAKE_CONVERSATION
from kvlens.schema import Outcome

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
    """The replay core's arguments for scenario rr8, as block_outcomes builds them (the warm-up):
    it calls ``replay_resume`` (the core from a given state, here the empty one), whose arguments
    are the core's plus the removal stamps, the groups per location, the state and a snapshot place."""
    captured: list[tuple[Any, ...]] = []
    resume = outcomes_mod.replay_resume

    def recording(*args: Any) -> Any:
        captured.append((args[0], *args[2:22]))
        return resume(*args)

    con = duckdb.connect()
    open_lake(con, lake)
    outcomes_mod.replay_resume = recording  # type: ignore[assignment]
    try:
        outcomes_mod.block_outcomes(
            requests=scenario_rows(con, "requests", "rr8"),
            request_blocks=scenario_rows(con, "request_blocks", "rr8"),
            kv_events=scenario_rows(con, "kv_events", "rr8"),
            transfers=scenario_rows(con, "transfers", "rr8"), scenario="rr8", bytes_per_token=1)
    finally:
        outcomes_mod.replay_resume = resume
        con.close()
    return captured[0]


def dict_replay(ev_ts: Any, ev_kind: Any, ev_loc: Any, ev_tier: Any, ev_grp: Any, ev_h: Any, ev_c: Any,
                ev_ns: Any, ev_left: Any, req_t: Any, req_loc: Any, req_tail: Any, req_bs: Any, req_off: Any,
                blk_h: Any, blk_c: Any, blk_ns: Any, blk_xfer: Any, n_locs: int, pool_loc: int,
                loc_window: Any) -> tuple[list[int], ...]:
    """The replay core's decisions with plain dicts, for one full-attention group (the simulated
    scenario's): residency[h] = bit mask of 3*loc + tier, copies beyond the first in ``extra``."""
    assert loc_window.shape[1] == 1 and not loc_window.any(), "the plain-dict replay is for dense models"
    del ev_grp, req_bs
    ev = list(zip(ev_ts.tolist(), ev_kind.tolist(), ev_loc.tolist(), ev_tier.tolist(), ev_h.tolist(),
                  ev_c.tolist(), ev_ns.tolist(), ev_left.tolist(), strict=True))
    bh, bc, bn, bx = blk_h.tolist(), blk_c.tolist(), blk_ns.tolist(), blk_xfer.tolist()
    n = len(bh)
    out, holder, rem_ts, rem_loc, other = [-1] * n, [-1] * n, [-1] * n, [-1] * n, [-1] * n
    cut, mask, served = [-1] * n, [0] * n, [-1] * n
    published = {loc for _, kind, loc, *_ in ev if kind != 2}
    res: dict[int, int] = {}
    extra: dict[tuple[int, int], int] = {}
    stored: set[int] = set()
    removed: dict[int, tuple[int, int]] = {}
    c_ns: dict[int, list[int]] = {}
    codes = {o: i for i, o in enumerate(Outcome)}
    here_mask = 7
    k = 0
    for i, t in enumerate(req_t.tolist()):
        while k < len(ev) and ev[k][0] < t:
            ts, kind, loc, tier, h, c, ns, left = ev[k]
            k += 1
            if kind == 2:
                sel = (here_mask << 3 * loc) if tier < 0 else (1 << 3 * loc + tier)
                for hh, m in list(res.items()):
                    if m & sel:
                        res[hh] = m & ~sel
                        removed[hh] = (ts, loc)
                        for bit in range(3 * n_locs):
                            if sel >> bit & 1:
                                extra.pop((hh, bit), None)
                continue
            bit = 3 * loc + tier
            if kind == 0:
                if res.get(h, 0) >> bit & 1:
                    extra[(h, bit)] = extra.get((h, bit), 0) + 1
                else:
                    res[h] = res.get(h, 0) | (1 << bit)
                stored.add(h)
                if c and ns != -1 and ns not in c_ns.setdefault(c, []):
                    c_ns[c].append(ns)
            elif res.get(h, 0) >> bit & 1:
                after = left if left >= 0 else extra.get((h, bit), 0)
                if after > 0:
                    extra[(h, bit)] = after - 1
                    continue
                extra.pop((h, bit), None)
                res[h] &= ~(1 << bit)
                removed[h] = (ts, loc)
        r = int(req_loc[i])
        b0, b1 = int(req_off[i]), int(req_off[i + 1])
        if r not in published:
            out[b0:b1] = [codes[Outcome.UNOBSERVED]] * (b1 - b0)
            continue
        chain = True
        for j in range(b0, b1):
            m = res.get(bh[j], 0)
            bits, x = m >> 3 * r & 7, bx[j]
            pooled = pool_loc >= 0 and m >> 3 * pool_loc & 7 != 0
            mask[j] = 1
            if chain and (bits or x == 1 or (pooled and x != 2)):
                served[j] = (0 if bits & 1 else 1 if bits & 2 else 2) if bits else 3 if x == 1 else 4
                out[j] = codes[(Outcome.HIT_LOCAL, Outcome.HIT_OFFLOAD, Outcome.HIT_OFFLOAD,
                                Outcome.HIT_REMOTE, Outcome.HIT_REMOTE)[served[j]]]
                continue
            chain = False
            rest = m & ~(here_mask << 3 * r) & ~((here_mask << 3 * pool_loc) if pool_loc >= 0 else 0)
            if x == 2:
                out[j] = codes[Outcome.MISS_LOAD_FAILED]
            elif bits or x == 1 or pooled:
                out[j] = codes[Outcome.MISS_AFTER_GAP]
            elif rest:
                out[j], holder[j] = codes[Outcome.MISS_ROUTING], ((rest & -rest).bit_length() - 1) // 3
            elif bh[j] in stored:
                out[j] = codes[Outcome.MISS_EVICTED]
                rem_ts[j], rem_loc[j] = removed.get(bh[j], (-1, -1))
            else:
                others = [v for v in c_ns.get(bc[j], []) if v != bn[j]] if bc[j] and bn[j] != -1 else []
                out[j], other[j] = (codes[Outcome.MISS_INCOMPATIBLE], others[0]) if others else \
                    (codes[Outcome.MISS_COLD], -1)
        if chain and not req_tail[i] and b1 > b0:
            out[b1 - 1], served[b1 - 1] = codes[Outcome.RECOMPUTED_LAST], -1
    return out, holder, rem_ts, rem_loc, other, cut, mask, served


def _prefix(args: tuple[Any, ...], n_req: int) -> tuple[Any, ...]:
    """The first ``n_req`` requests, their blocks, and the events before their last look-up."""
    ev, (req_t, req_loc, req_tail, req_bs, req_off), blk = args[:9], args[9:14], args[14:18]
    n_blk = int(req_off[n_req])
    n_ev = int(np.searchsorted(ev[0], req_t[n_req - 1], side="left"))
    return (*(a[:n_ev] for a in ev), req_t[:n_req], req_loc[:n_req], req_tail[:n_req], req_bs[:n_req],
            req_off[:n_req + 1], *(a[:n_blk] for a in blk), *args[18:])


def _best_of(n: int, fn: Any, *args: Any) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> bool:
    core = replay_core
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        lake = _lake(Path(tmp))
        setup_s = time.perf_counter() - t0
        args = _capture(lake)
        n_blk, n_ev = len(args[14]), len(args[0])
        core_s, core_full = _best_of(3, core, *args)
        dict_s, dict_full = _best_of(1, dict_replay, *args)
        dict_agree = all(np.asarray(a).tolist() == list(b) for a, b in zip(core_full, dict_full, strict=True))
        small = _prefix(args, ORACLE_REQUESTS)
        n_small = len(small[14])
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
