"""Tests for the what-if simulator, checked through the miss ledger on the shipped Mooncake trace.

The conversation trace is imported once per module; each simulated scenario is written to the
lake and replayed by the ledger exactly as ``kvlens simulate`` + ``kvlens analyze`` would, so
the ledger's hit tokens can be held to the simulator's own ``cached_tokens`` request by request.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner, Result

from kvlens.analyzers import block_outcomes, request_ledger, scenario_rows
from kvlens.analyzers.simulate import Engine, SimConfig, SimResult, simulate
from kvlens.cli import cli
from kvlens.collector.importer import import_files
from kvlens.errors import ConfigError
from kvlens.lake import open_lake, write_scenario
from kvlens.models import ModelGeometry, get_model
from kvlens.sample_data import MOONCAKE_CONVERSATION
from kvlens.sample_data.demo import INFINITE_CACHE_SQL, WHAT_IFS
from kvlens.schema import RoutingPolicy

pytestmark = pytest.mark.slow  # a dozen simulations of a 12k-request trace, each through the ledger

MODEL = "llama-3.1-70b"
SUBSET = 2500  # requests (the earliest) for the pool and routing-policy tests


@dataclass
class Scenario:
    name: str
    outcomes: pl.DataFrame  # block_outcomes
    per_request: pl.DataFrame  # request_ledger
    transfers: pl.DataFrame
    sim: SimResult | None = None

    def tokens(self, *outcomes: str) -> int:
        return int(self.outcomes.filter(pl.col("outcome").is_in(outcomes))["tokens"].sum() or 0)

    @property
    def prompt_tokens(self) -> int:
        return int(self.per_request["prompt_tokens"].sum())

    @property
    def hit_tokens(self) -> int:
        return int(self.per_request["hit_tokens"].sum())

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens

    def share(self, outcome: str) -> float:
        return self.tokens(outcome) / self.prompt_tokens

    def ttft_p99_ms(self) -> float:
        return float(np.percentile(self.per_request["ttft_ms"].to_numpy(), 99))

    def summary(self) -> str:
        by = self.outcomes.group_by("outcome").agg(pl.col("tokens").sum()).sort("outcome").rows()
        parts = ", ".join(f"{o} {t / self.prompt_tokens:.1%}" for o, t in by)
        ttft = self.per_request["ttft_ms"].to_numpy()
        return (f"{self.name:>14}: hit ratio {self.hit_ratio:.4f}; "
                f"TTFT P50 {np.percentile(ttft, 50):,.0f} ms P99 {np.percentile(ttft, 99):,.0f} ms; {parts}")

    def assert_ledger_agrees_with_simulator(self) -> None:
        # The ledger's replay of the events reaches the simulator's own decisions, per request.
        diff = self.per_request.filter(pl.col("cached_tokens") != pl.col("hit_tokens"))
        assert diff.height == 0, diff.head(5)


class Lab:
    """The imported trace, and every simulated scenario computed once per module."""

    def __init__(self, lake: Path) -> None:
        self.lake = lake
        self.model: ModelGeometry = get_model(MODEL)
        con = duckdb.connect()
        open_lake(con, lake)
        self.requests = con.sql("SELECT * FROM requests WHERE scenario = 'conv'").pl()
        self.blocks = con.sql("SELECT * FROM request_blocks WHERE scenario = 'conv'").pl()
        con.close()
        first = self.requests.sort("arrival_ns", "request_id").head(SUBSET)["request_id"]
        self.sub_requests = self.requests.filter(pl.col("request_id").is_in(first.implode()))
        self.sub_blocks = self.blocks.filter(pl.col("request_id").is_in(first.implode()))
        self._cache: dict[str, Scenario] = {}

    def simulate(self, config: SimConfig, *, subset: bool = False) -> SimResult:
        reqs, blocks = (self.sub_requests, self.sub_blocks) if subset else (self.requests, self.blocks)
        return simulate(requests=reqs, request_blocks=blocks, config=config, model=self.model)

    def scenario(self, name: str, config: SimConfig | None = None, *, subset: bool = False) -> Scenario:
        """Simulate ``config`` into scenario ``name`` (once), then run the ledger over the lake."""
        if name not in self._cache:
            sim = None
            if config is not None:
                sim = self.simulate(config, subset=subset)
                write_scenario(self.lake, name, {k: v.to_arrow() for k, v in sim.tables.items()},
                               writer_id="simulate")
            self._cache[name] = self.ledger(name, sim)
        return self._cache[name]

    def ledger(self, name: str, sim: SimResult | None = None) -> Scenario:
        con = duckdb.connect()
        open_lake(con, self.lake)
        try:
            outcomes = block_outcomes(
                requests=scenario_rows(con, "requests", name),
                request_blocks=scenario_rows(con, "request_blocks", name),
                kv_events=scenario_rows(con, "kv_events", name),
                transfers=scenario_rows(con, "transfers", name), scenario=name,
                bytes_per_token=self.model.kv_bytes_per_token())
            per = request_ledger(block_outcomes=outcomes, requests=scenario_rows(con, "requests", name))
            xfers = con.sql(f"SELECT * FROM transfers WHERE scenario = '{name}'").pl()
        finally:
            con.close()
        return Scenario(name, outcomes, per, xfers, sim)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lake = tmp_path_factory.mktemp("sim") / "lake"
    result = import_files("mooncake", [MOONCAKE_CONVERSATION], lake, scenario="conv", model=MODEL)
    assert result.requests == 12_031
    yield Lab(lake)


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


# -- one replica: the ledger against the trace's own infinite-cache share ----------------------


def test_one_replica_unbounded_equals_infinite_cache(lab: Lab) -> None:
    one = lab.scenario("one", SimConfig(replicas=1))
    con = duckdb.connect()
    open_lake(con, lab.lake)
    [(requests, prompt, _blocks, _distinct, reusable, ratio)] = con.execute(
        INFINITE_CACHE_SQL, {"scenario": "conv"}).fetchall()
    con.close()
    print(f"\n{one.summary()}\n   infinite-cache SQL: {reusable:,} of {prompt:,} tokens = {ratio:.4f}")
    assert one.per_request.height == requests == 12_031
    assert one.prompt_tokens == prompt
    # The SQL counts every repeated full block; the ledger gives back the last block of a
    # tail-less, all-hit prompt (recomputed_last). Together they are the same tokens exactly.
    assert one.hit_tokens + one.tokens("recomputed_last") == reusable
    assert one.tokens("recomputed_last") == 0  # on this trace no tail-less prompt is a full hit
    assert one.hit_tokens == reusable
    assert one.hit_ratio == pytest.approx(float(ratio), rel=0, abs=1e-12)
    assert set(one.outcomes["outcome"].unique()) <= {"hit_local", "miss_cold", "recomputed_last"}
    assert one.sim is not None and one.sim.hit_tokens == one.hit_tokens
    one.assert_ledger_agrees_with_simulator()


# -- one replica, bounded: hits fall with capacity, and the loss is miss_evicted ---------------

CAPACITIES = (20_000_000, 5_000_000, 1_000_000)


def test_bounded_capacity_loses_hits_to_eviction(lab: Lab) -> None:
    unbounded = lab.scenario("one", SimConfig(replicas=1))
    runs = [lab.scenario(f"one-cap{c // 1_000_000}m", SimConfig(replicas=1, capacity_tokens=c))
            for c in CAPACITIES]
    print()
    for s in (unbounded, *runs):
        print(s.summary())
    ratios = [unbounded.hit_ratio] + [s.hit_ratio for s in runs]
    assert all(a > b for a, b in itertools.pairwise(ratios)), ratios
    evicted = [s.tokens("miss_evicted") for s in runs]
    assert evicted[0] > 0
    assert all(a < b for a, b in itertools.pairwise(evicted)), evicted
    for s in runs:
        # Cold misses do not depend on capacity; every lost hit is an eviction, or a resident
        # block behind an evicted one (miss_after_gap). Nothing else appears on one replica.
        assert s.tokens("miss_cold") == unbounded.tokens("miss_cold")
        lost = unbounded.hit_tokens - s.hit_tokens
        assert lost == s.tokens("miss_evicted") + s.tokens("miss_after_gap") + s.tokens("recomputed_last")
        assert s.tokens("miss_evicted") >= 0.9 * lost
        assert s.tokens("miss_routing", "miss_incompatible", "miss_load_failed", "hit_remote") == 0
        # Each eviction names its removal: before the request's look-up, on the one replica.
        evictions = s.outcomes.filter(pl.col("outcome") == "miss_evicted").join(
            s.per_request.select("request_id", "queue_ms"), on="request_id")
        lookup_ns = evictions["arrival_ns"] + (evictions["queue_ms"] * 1e6).round().cast(pl.Int64)
        assert evictions["removed_ns"].null_count() == 0 and set(evictions["remover"]) == {"replica-0"}
        assert (evictions["removed_ns"] < lookup_ns).all()
        s.assert_ledger_agrees_with_simulator()


# -- eight replicas: the demo's what-ifs (sample_data/demo.py) -----------------------------------


def _queue_p99_ms(s: Scenario) -> float:
    return float(np.percentile(s.per_request["queue_ms"].to_numpy(), 99))


def test_demo_fleet_cache_aware_doubles_the_hits_and_cuts_the_tail(lab: Lab) -> None:
    # 8 vLLM replicas of 4x H100 with 500k tokens of KV each, at the trace's own rate: round robin
    # recomputes each conversation's earlier turns and queues; cache-aware routing finds them, so
    # the recompute that filled the queues goes, and the tail with it. The 2x fallback moves the
    # few requests a hot replica would have kept waiting.
    rr, ca, lf = (lab.scenario(name, config) for name, config in WHAT_IFS.items())
    print()
    for s in (rr, ca, lf):
        print(f"{s.summary()}; queue P99 {_queue_p99_ms(s):,.0f} ms")
        assert set(s.per_request["replica"].unique()) == {f"replica-{i}" for i in range(8)}
        s.assert_ledger_agrees_with_simulator()
    assert _queue_p99_ms(rr) > 5_000  # round robin queues at this load
    assert ca.hit_ratio > 2 * rr.hit_ratio
    assert ca.ttft_p99_ms() < rr.ttft_p99_ms()
    assert lf.ttft_p99_ms() <= ca.ttft_p99_ms()
    assert ca.hit_ratio - 0.10 <= lf.hit_ratio <= ca.hit_ratio
    assert rr.share("miss_routing") >= 0.10 and ca.share("miss_routing") < rr.share("miss_routing") / 3
    # Holders of miss_routing blocks are other replicas, never the serving one.
    routed = rr.outcomes.filter(pl.col("outcome") == "miss_routing")
    assert routed["holder"].null_count() == 0 and (routed["holder"] != routed["replica"]).all()


def test_simulate_cli_says_its_times_are_modelled(lab: Lab) -> None:
    result = run("simulate", "--lake", lab.lake, "--from", "conv", "--scenario", "cli8", "--replicas", "8",
                 "--routing", "cache_aware", "--load-factor", "2", "--model", MODEL)
    assert result.exit_code == 0, result.output
    assert "12,031 requests" in result.stdout
    assert "blocks of 512 tokens per replica" in result.stdout
    assert "times are modelled: 8x H100" in result.stdout


def test_recorded_routing_keeps_every_request_on_its_replica(lab: Lab) -> None:
    rr = lab.scenario("rr8")
    assert rr.sim is not None
    source = rr.sim.tables["requests"].with_columns(replica=pl.col("replica") + "-as-recorded")
    sim = simulate(requests=source, request_blocks=lab.blocks, model=lab.model,
                   config=SimConfig(replicas=8, routing=RoutingPolicy.RECORDED, capacity_tokens=500_000,
                                    device=WHAT_IFS["rr8"].device))
    out = sim.tables["requests"].join(source.select("request_id", recorded="replica"), on="request_id")
    assert out.height == 12_031 and (out["replica"] == out["recorded"]).all()
    # The same placement at the same configuration is the same what-if.
    assert sim.hit_tokens == rr.sim.hit_tokens
    with pytest.raises(ConfigError, match="pass --replicas 8"):
        simulate(requests=source, request_blocks=lab.blocks, model=lab.model,
                 config=SimConfig(replicas=4, routing=RoutingPolicy.RECORDED))


def test_the_lru_engine_is_kept(lab: Lab) -> None:
    sim = lab.simulate(SimConfig(replicas=4, engine=Engine.LRU, capacity_tokens=3_000_000), subset=True)
    reqs = sim.tables["requests"]
    assert reqs.height == SUBSET and sim.hit_tokens == int(reqs["cached_tokens"].sum()) > 0
    assert "steps" not in sim.stats  # it has service slots, not steps


# -- a shared pool -------------------------------------------------------------------------------


def test_pool_hits_are_remote_with_transfers(lab: Lab) -> None:
    config = SimConfig(replicas=4, pool_tokens=50_000_000)
    pooled = lab.scenario("pool4", config, subset=True)
    plain = lab.scenario("rr4", SimConfig(replicas=4), subset=True)
    print(f"\n{plain.summary()}\n{pooled.summary()}")
    remote = pooled.outcomes.filter(pl.col("outcome") == "hit_remote")
    assert remote.height > 0
    assert pooled.hit_ratio > plain.hit_ratio
    pooled.assert_ledger_agrees_with_simulator()
    loads = pooled.transfers.filter(pl.col("replica") != "pool")
    stores = pooled.transfers.filter(pl.col("replica") == "pool")
    assert loads.height > 0 and stores.height > 0
    assert set(loads["origin"]) == {"pool"} and set(loads["status"].cast(pl.Utf8)) == {"ok"}
    # Unbounded local caches: a block after the local prefix is never local, so each load is a hit.
    assert loads.height == remote.height
    # Every hit_remote block has its load: status ok, received by the serving replica.
    matched = remote.join(loads.select("request_id", "block_hash", pl.col("replica").alias("receiver")),
                          on=["request_id", "block_hash"], how="left")
    assert matched["receiver"].null_count() == 0
    assert (matched["receiver"] == matched["replica"]).all()
    # The pool's stores are not loads: a block the request wrote into the pool is not a hit.
    stored = pooled.outcomes.join(stores.select("request_id", "block_hash"), on=["request_id", "block_hash"])
    assert stored.height > 0
    assert not stored["outcome"].str.starts_with("hit_").any()
    assert set(stores["origin"]) <= {f"replica-{i}" for i in range(4)}


# -- every routing policy runs; bad configurations are refused -----------------------------------


def _replicas(sim: SimResult) -> list[str]:
    return sim.tables["requests"].sort("request_id")["replica"].to_list()


@pytest.mark.parametrize("policy", [p for p in RoutingPolicy if p != RoutingPolicy.RECORDED])
def test_every_policy_routes_every_request(lab: Lab, policy: RoutingPolicy) -> None:
    sim = lab.simulate(SimConfig(replicas=4, routing=policy, seed=7), subset=True)
    reqs = sim.tables["requests"]
    assert reqs.height == SUBSET
    assert set(reqs["request_id"]) == set(lab.sub_requests["request_id"])
    assert set(reqs["replica"]) <= {f"replica-{i}" for i in range(4)}
    assert reqs["replica"].null_count() == 0
    # Every request of this trace shares its first block (a common system prompt): no policy may
    # follow it to a single replica.
    assert reqs["replica"].n_unique() > 1
    heads = lab.sub_blocks.filter(pl.col("position") < 4).sort("position").group_by("request_id").agg(
        head=pl.col("block_hash"))
    routed = reqs.join(heads, on="request_id")
    # No session ids in this trace: session_affinity knows a conversation by its first 4 blocks.
    if policy in (RoutingPolicy.SESSION_AFFINITY, RoutingPolicy.PREFIX_HASH):
        assert (routed.group_by("head").agg(pl.col("replica").n_unique())["replica"] == 1).all()
    if policy == RoutingPolicy.ROUND_ROBIN:
        ordered = reqs.sort("arrival_ns", "request_id")["replica"].to_list()
        assert ordered[:8] == [f"replica-{i % 4}" for i in range(8)]


def test_rate_scale_packs_the_arrivals(lab: Lab) -> None:
    reqs = lab.sub_requests.sort("arrival_ns", "request_id").head(300)
    sim = simulate(requests=reqs, request_blocks=lab.sub_blocks, model=lab.model,
                   config=SimConfig(replicas=2, rate_scale=2.0))
    got = sim.tables["requests"].sort("arrival_ns", "request_id")["arrival_ns"].to_numpy()
    t = reqs["arrival_ns"].to_numpy()
    assert np.array_equal(got - got[0], np.round((t - t[0]) / 2).astype(np.int64))


def test_random_routing_is_reproducible(lab: Lab) -> None:
    def config(seed: int) -> SimConfig:
        return SimConfig(replicas=4, routing=RoutingPolicy.RANDOM, seed=seed)

    a, b, c = (lab.simulate(config(s), subset=True) for s in (7, 7, 8))
    assert _replicas(a) == _replicas(b)
    assert _replicas(a) != _replicas(c)
    assert a.tables["kv_events"].equals(b.tables["kv_events"])


@pytest.mark.parametrize("bad", [
    {"replicas": 0}, {"replicas": 2, "capacity_tokens": 0}, {"replicas": 2, "pool_tokens": -5},
    {"replicas": 2, "load_factor": 0.0}, {"replicas": 2, "load_factor": -1.0},
    {"replicas": 2, "gpu_blocks": 1}, {"replicas": 2, "gpu_blocks": 100, "capacity_tokens": 5000},
    {"replicas": 2, "gpu_blocks": 100, "engine": "lru"},
    {"replicas": 2, "max_batched_tokens": 4, "max_seqs": 8}, {"replicas": 2, "rate_scale": 0.0},
    {"replicas": 2, "gpu_blocks": 3},  # a replica of 2 usable blocks cannot hold the longest request
])
def test_invalid_config_is_a_config_error(lab: Lab, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        simulate(requests=lab.sub_requests.head(5), request_blocks=lab.sub_blocks, model=lab.model,
                 config=SimConfig(**bad))


def test_an_unbounded_cache_too_large_to_hold_is_refused(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvlens.analyzers.sim_vllm as sim_vllm

    monkeypatch.setattr(sim_vllm, "MAX_FLEET_BLOCKS", 1_000)
    with pytest.raises(ConfigError, match="give --gpu-blocks or --capacity-tokens"):
        simulate(requests=lab.sub_requests.head(50), request_blocks=lab.sub_blocks, model=lab.model,
                 config=SimConfig(replicas=8))


def test_simulate_cli_errors(lab: Lab) -> None:
    missing = run("simulate", "--lake", lab.lake, "--from", "nope", "--scenario", "x", "--replicas", "2")
    assert missing.exit_code == 1 and missing.stdout == ""
    lines = missing.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and "nope" in lines[0]
    factor = run("simulate", "--lake", lab.lake, "--from", "conv", "--scenario", "x", "--replicas", "2",
                 "--routing", "cache_aware", "--load-factor", "0")
    assert factor.exit_code == 1 and factor.stderr.startswith("Error:") and "load-factor" in factor.stderr
    bogus = run("simulate", "--lake", lab.lake, "--from", "conv", "--scenario", "x", "--replicas", "2",
                "--routing", "bogus")
    assert bogus.exit_code == 1 and bogus.stderr.startswith("Error:")  # a usage error: 1, as README says
    assert not (lab.lake / "requests" / "scenario=x").exists()


def test_session_affinity_follows_the_session_id_over_the_blocks() -> None:
    # Six sessions, two requests each, every request with blocks of its own: a session's two
    # requests meet on one replica although they share no block.
    sessions = [f"s{i // 2}" for i in range(12)]
    requests = pl.DataFrame({
        "request_id": [f"r{i:02d}" for i in range(12)], "arrival_ns": list(range(12)),
        "session_id": sessions, "prompt_tokens": [32] * 12, "output_tokens": [1] * 12,
        "model": [None] * 12, "tenant": [None] * 12}, schema_overrides={"model": pl.Utf8, "tenant": pl.Utf8})
    blocks = pl.DataFrame({
        "request_id": [f"r{i:02d}" for i in range(12) for _ in range(2)],
        "position": [p for _ in range(12) for p in range(2)],
        "block_hash": list(range(100, 124)), "content_hash": list(range(100, 124)),
        "block_tokens": [16] * 24, "block_size_tokens": [16] * 24, "namespace": ["m"] * 24},
        schema_overrides={"block_hash": pl.UInt64, "content_hash": pl.UInt64})
    sim = simulate(requests=requests, request_blocks=blocks, model=get_model("llama-3.1-8b"),
                   config=SimConfig(replicas=4, routing=RoutingPolicy.SESSION_AFFINITY))
    routed = sim.tables["requests"].group_by("session_id").agg(pl.col("replica").n_unique())
    assert routed["replica"].to_list() == [1] * 6
    assert sim.tables["requests"]["replica"].n_unique() > 1
