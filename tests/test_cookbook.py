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
