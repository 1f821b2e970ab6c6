"""The compiled vLLM fleet (analyzers/scheduler.py, analyzers/vllm_cache.py): vLLM's rules, hand-checked,
then held to the pure-Python oracle (tests/vllm_oracle.py) on random fleets, output for output."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kvlens.analyzers.scheduler import run_fleet
from kvlens.analyzers.step_time import N_PARAMS
from tests.vllm_oracle import run_fleet_py

STEP = np.zeros(N_PARAMS)
STEP[0] = 1.0  # every step takes 1 ms: the hand-made cases below count steps, not FLOPs
ROWS = ("replica", "sched", "first", "end", "cached", "ext", "preempted", "moved")
STORED, REMOVED = 0, 1


def fleet(reqs: list[tuple[int, int, int, list[int]]], *, gpu_blocks: int, block: int = 2, replicas: int = 1,
          max_seqs: int = 8, budget: int = 2048, fixed: list[int] | None = None, threshold: float = 0.5,
          load_factor: float = 0.0, pool_blocks: int = 0, step: np.ndarray = STEP) -> dict[str, Any]:
    """Run both engines on (arrival ns, prompt tokens, output tokens, prompt full-block hashes)."""
    arrival = np.array([r[0] for r in reqs], np.int64)
    prompt = np.array([r[1] for r in reqs], np.int64)
    out = np.array([r[2] for r in reqs], np.int64)
    hashes, off = [], [0]
    for i, (_a, p, o, h) in enumerate(reqs):
        n = (p + o - 1) // block
        hashes += (list(h) + [10**12 + 1000 * i + k for k in range(n)])[:n]  # generated blocks: own hashes
        off.append(len(hashes))
    n_pfull = prompt // block
    fixed_arr = np.array(fixed if fixed is not None else [0] * len(reqs), np.int64)
    blk_off, blk_h = np.array(off, np.int64), np.array(hashes, np.int64)
    order = np.argsort(arrival, kind="stable")
    rows, ev, xf, cnt, steps = run_fleet(
        arrival, order, prompt, out, blk_off, blk_h, n_pfull, fixed_arr, replicas, gpu_blocks, block,
        max_seqs, budget, threshold, load_factor, pool_blocks, step, 10_000, 10_000)
    cfg = {"replicas": replicas, "gpu_blocks": gpu_blocks, "block": block, "max_seqs": max_seqs,
           "max_batched_tokens": budget, "cache_threshold": threshold, "load_factor": load_factor,
           "pool_blocks": pool_blocks}
    oracle = run_fleet_py(arrival, order, prompt, out, blk_off, blk_h, n_pfull, fixed_arr, cfg, step)
    got = {name: rows[k].tolist() for k, name in enumerate(ROWS)}
    for name in ROWS:
        assert got[name] == oracle[name], name
    assert ev.tolist() == [list(e) for e in oracle["events"]]
    assert xf.tolist() == [list(x) for x in oracle["transfers"]]
    assert steps == oracle["steps"] and cnt[2] == 0
    return {**got, "events": [tuple(e) for e in ev.tolist()], "transfers": xf.tolist()}


def kinds(result: dict[str, Any], loc: int = 0) -> list[tuple[str, int]]:
    return [("stored" if k == STORED else "removed", h)
            for _ts, lo, k, h, _r, _p in result["events"] if lo == loc]


# -- vLLM's rules, one hand-made case each ----------------------------------------------------------


def test_a_finished_request_frees_tail_first_so_its_tail_is_evicted_first() -> None:
    # 4 blocks = the null block + 3. A caches a0, a1 and finishes: the queue is [3, a1, a0] (its
    # blocks freed tail first, appended). B's two blocks take 3 and a1's: a1 is evicted, a0 stays.
    # C (a0, a1, ...) then hits a0. An LRU of prompt blocks would have evicted a0 (older) first.
    r = fleet([(0, 4, 1, [100, 101]), (10**9, 4, 1, [200, 201]), (2 * 10**9, 5, 1, [100, 101])], gpu_blocks=4)
    assert kinds(r) == [("stored", 100), ("stored", 101), ("removed", 101), ("stored", 200), ("stored", 201),
                        ("removed", 201), ("removed", 200), ("stored", 101)]
    assert r["cached"] == [0, 0, 2]


def test_the_null_block_holds_nothing() -> None:
    # 3 blocks = 2 usable: two 2-block requests in turn, the second evicts both of the first's.
    r = fleet([(0, 4, 1, [1, 2]), (10**9, 4, 1, [3, 4]), (2 * 10**9, 4, 1, [1, 2])], gpu_blocks=3)
    assert r["cached"] == [0, 0, 0]
    assert [k for k in kinds(r) if k[0] == "removed"][:2] == [("removed", 2), ("removed", 1)]


def test_the_last_prompt_token_is_always_computed() -> None:
    # A prompt of exactly two full blocks, both cached: only the first is served from the cache.
    r = fleet([(0, 4, 1, [7, 8]), (10**9, 4, 1, [7, 8]), (2 * 10**9, 5, 1, [7, 8])], gpu_blocks=10)
    assert r["cached"] == [0, 2, 4]


def test_blocks_of_generated_tokens_are_cached_and_a_partial_block_never() -> None:
    # 3 prompt tokens (one full block + 1), 4 output tokens: 3 + 3 computed = 6 tokens = 3 full
    # blocks cached (two hold generated tokens, with their own hashes); the 7th token never computed.
    r = fleet([(0, 3, 4, [5])], gpu_blocks=10)
    stored = [(h, pos) for _ts, _lo, k, h, _r, pos in r["events"] if k == STORED]
    assert [pos for _h, pos in stored] == [0, 1, 2] and stored[0][0] == 5


def test_a_hit_on_a_free_block_takes_it_out_of_the_queue() -> None:
    # 5 blocks = 4 usable. A (x0, x1) finishes; B hits x0 (free, cached: taken out of the queue,
    # referenced) and allocates 2 more: the queue's head is an unused block then a1... x0 survives.
    r = fleet([(0, 4, 1, [1, 2]), (10**9, 6, 3, [1, 90, 91]), (2 * 10**9, 3, 1, [1])], gpu_blocks=5)
    assert r["cached"][1] == 2 and r["cached"][2] == 2


def test_preemption_takes_the_last_running_request_and_keeps_its_first_hit() -> None:
    # 5 blocks = 4 usable, block 2: A and B (2-token prompts) decode side by side until A needs a
    # block none is free for: it preempts B (the last running), which restarts and finishes later.
    r = fleet([(0, 2, 5, [1]), (0, 2, 5, [3])], gpu_blocks=5)
    assert r["preempted"] == [0, 1]
    assert r["end"][0] < r["end"][1]
    assert r["cached"] == [0, 0]


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    # 5 usable blocks: A holds 4; B needs 3 (its whole prompt must fit) and waits; C (1 block) is
    # behind B in FCFS order and waits too, although it would fit: both start as A ends.
    r = fleet([(0, 6, 3, [1, 2, 3]), (1, 6, 1, [4, 5, 6]), (2, 2, 1, [7])], gpu_blocks=6)
    assert r["sched"][1:] == [r["end"][0] + 1, r["end"][0] + 2]


def test_chunked_prefill_spreads_a_prompt_over_steps_of_the_token_budget() -> None:
    r = fleet([(0, 40, 2, list(range(20)))], gpu_blocks=40, budget=16)
    # 40 tokens at 16 a step: 3 prefill steps, then 1 decode; every step 1 ms.
    assert r["first"][0] - r["sched"][0] == 3 * 10**6 - 1
    assert r["end"][0] - r["first"][0] == 10**6


# -- the oracle, on random fleets --------------------------------------------------------------------


def _workload(rng: random.Random, n: int, block: int) -> list[tuple[int, int, int, list[int]]]:
    systems = [[rng.randrange(10**6) for _ in range(rng.randrange(1, 6))] for _ in range(4)]
    sessions: dict[int, list[int]] = {}
    reqs, t = [], 0
    for _ in range(n):
        t += rng.choice((0, 0, 1, rng.randrange(10**6), rng.randrange(10**8)))
        s = rng.randrange(6)
        if s not in sessions or rng.random() < 0.2:
            sessions[s] = list(rng.choice(systems))
        sessions[s] += [rng.randrange(10**6) for _ in range(rng.randrange(0, 4))]
        prompt = len(sessions[s]) * block + rng.randrange(block)
        reqs.append((t, max(prompt, 1), rng.randrange(1, 12), list(sessions[s])))
    return reqs


CASES = [
    {"gpu_blocks": 12, "max_seqs": 4, "budget": 8},  # evictions, preemptions, chunked prefill
    {"gpu_blocks": 30, "max_seqs": 8, "budget": 2048},
    {"gpu_blocks": 20, "replicas": 3, "routing": "cache_aware", "load_factor": 1.5},
    {"gpu_blocks": 16, "replicas": 2, "routing": "cache_aware", "pool_blocks": 10, "budget": 12},
    {"gpu_blocks": 14, "replicas": 3, "routing": "round_robin", "max_seqs": 2},
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_the_compiled_fleet_equals_the_oracle(case: dict[str, Any], seed: int) -> None:
    rng = random.Random(seed)
    block = rng.choice((2, 4))
    reqs = _workload(rng, 80, block)
    limit = case["gpu_blocks"] - 1
    reqs = [r for r in reqs if -(-(r[1] + r[2] - 1) // block) <= limit]
    replicas = case.get("replicas", 1)
    routing = case.get("routing", "fixed")
    fixed = ([-1] * len(reqs) if routing == "cache_aware"
             else [i % replicas for i in range(len(reqs))])
    step = np.zeros(N_PARAMS)
    step[0], step[1], step[2], step[3] = 0.5, 0.3, 0.01, 1e-5
    step[11], step[12] = 0.2, 0.001
    result = fleet(reqs, gpu_blocks=case["gpu_blocks"], block=block, replicas=replicas,
                   max_seqs=case.get("max_seqs", 8), budget=case.get("budget", 2048), fixed=fixed,
                   load_factor=case.get("load_factor", 0.0), pool_blocks=case.get("pool_blocks", 0),
                   step=step)
    assert all(e >= 0 for e in result["end"])  # every request was served
