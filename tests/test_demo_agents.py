"""The demo's synthetic agent service: its two planted faults are found, and nothing else is."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import duckdb

from kvlens.sample_data.agents import BLOCK_TOKENS, TENANTS
from kvlens.sample_data.demo import AGENT_WHAT_IF


def _log(workdir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (workdir / "agents_gateway.jsonl").read_text().splitlines()]


def test_hygiene_finds_exactly_the_timestamped_requests(demo_workdir: Path) -> None:
    acme = [r for r in _log(demo_workdir) if r["tenant"] == "acme"]  # in arrival order
    heads = Counter(tuple(r["token_ids"][:8]) for r in acme)  # type: ignore[index]
    usual = heads.most_common(1)[0][0]
    stamped = {r["request_id"] for r in acme if tuple(r["token_ids"][:8]) != usual}  # type: ignore[index]
    # A split is judged against earlier requests: a request splits when its first block is new
    # while an earlier request of the same system prompt exists (the very first one cannot split;
    # the first unstamped one after stamped ones does).
    expected, seen = set(), set()
    for r in acme:
        head = tuple(r["token_ids"][:BLOCK_TOKENS])  # type: ignore[index]
        if head not in seen and seen:
            expected.add(r["request_id"])
        seen.add(head)
    con = duckdb.connect(str(demo_workdir / "kvlens.duckdb"), read_only=True)
    rows = con.execute("SELECT request_id, split_position, lost_tokens FROM hygiene WHERE scenario = ?",
                       [AGENT_WHAT_IF]).fetchall()
    con.close()
    assert 0.2 * len(acme) < len(stamped) < 0.4 * len(acme)
    assert len(expected ^ stamped) <= 2 and {r[0] for r in rows} == expected
    assert {r[1] for r in rows} == {0}
    # At least the rest of the system prompt and the tools: every block after the stamped one.
    _, system_blocks, tool_blocks = TENANTS["acme"]
    assert min(r[2] for r in rows) == (system_blocks - 1 + tool_blocks) * BLOCK_TOKENS


def test_isolation_reports_the_shared_public_prompt(demo_workdir: Path) -> None:
    con = duckdb.connect(str(demo_workdir / "kvlens.duckdb"), read_only=True)
    rows = con.execute("SELECT finding, severity, subject, blocks FROM isolation_findings WHERE scenario = ?",
                       [AGENT_WHAT_IF]).fetchall()
    mooncake = con.execute("SELECT count(*) FROM isolation_findings WHERE scenario <> ?",
                           [AGENT_WHAT_IF]).fetchone()
    con.close()
    cross = [r for r in rows if r[0] == "cross_tenant_reuse"]
    assert cross and all(r[1] == "high" for r in cross)
    assert {tuple(sorted(r[2].split(" -> "))) for r in cross} == {("bolt", "corp")}
    assert mooncake == (0,)  # no tenants in the Mooncake trace: nothing to report there
