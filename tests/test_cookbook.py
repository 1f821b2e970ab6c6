"""docs/cookbook.md: every ```sql block runs on the demo's analysis DB and returns the columns it promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlens.query import query

COOKBOOK = Path(__file__).resolve().parents[1] / "docs" / "cookbook.md"
_RECIPE = re.compile(r"^## (?P<title>.+?)\n(?P<body>.*?)^```sql\n(?P<sql>.*?)^```", re.M | re.S)


def recipes(text: str) -> list[tuple[str, list[str], str]]:
    """(title, promised columns, sql) for every ```sql block, each under a ## title."""
    out = []
    for m in _RECIPE.finditer(text):
        returns = re.search(r"^Returns: (.+)$", m["body"], re.M)
        assert returns, f"recipe {m['title']!r} has no Returns: line"
        out.append((m["title"], re.findall(r"`([^`]+)`", returns[1]), m["sql"]))
    return out


RECIPES = recipes(COOKBOOK.read_text(encoding="utf-8"))


def test_every_sql_block_is_a_recipe() -> None:
    blocks = re.findall(r"^```sql\n", COOKBOOK.read_text(encoding="utf-8"), re.M)
    assert len(RECIPES) == len(blocks) >= 10
    titles = [t for t, _, _ in RECIPES]
    assert len(set(titles)) == len(titles)


@pytest.mark.parametrize(("title", "columns", "sql"), RECIPES, ids=[t for t, _, _ in RECIPES])
def test_recipe_runs_on_the_demo_db(title: str, columns: list[str], sql: str, demo_workdir: Path) -> None:
    got, _ = query(sql, db=demo_workdir / "kvlens.duckdb")
    assert got == columns, f"{title}: returns {got}, promises {columns}"


def test_recipes_on_the_ledger_find_rows(demo_workdir: Path) -> None:
    # The ledger is always there: its recipes must find something (the check can fail).
    for title, _, sql in RECIPES:
        if title in ("Hit ratio per replica", "Routing misses by holder",
                     "Blocks most often lost to eviction"):
            _, rows = query(sql, db=demo_workdir / "kvlens.duckdb")
            assert rows, title


def test_reusable_share_definitions_on_the_mooncake_trace(demo_workdir: Path) -> None:
    # README's comparison with other tools' figures rests on these numbers (issue 18, item 8).
    recipe = {t: sql for t, _, sql in RECIPES}
    _, rows = query(recipe["Reusable share of a trace, as kvlens and as other tools count it"],
                    db=demo_workdir / "kvlens.duckdb")
    got = {d.split(":")[0]: round(r, 4) for d, r in rows}
    assert got == {"kvlens": 0.3734, "partial tails counted as reused / prompt tokens": 0.3957,
                   "blocks needed again / blocks": 0.3664, "mean of per-request block ratios": 0.3843}
    _, rows = query(recipe["Hit share at a cache capacity, from the reuse distances"],
                    db=demo_workdir / "kvlens.duckdb")
    assert {tuple(round(v, 4) for v in r[2:]) for r in rows} == {(0.3415, 0.3493, 0.3638)}
