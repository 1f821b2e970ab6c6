"""The hit outcomes are spelt once, in kvlens/schema.py (Outcome, HIT_OUTCOMES, HIT_OUTCOMES_SQL)."""

from __future__ import annotations

import ast
from pathlib import Path

from kvlens.schema import HIT_OUTCOMES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvlens", "collector", "analyzers", "dashboards", "gpu_probe", "sample_data")


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _spellings(text: str) -> list[str]:
    """Hit outcomes a string names as a value: the whole string, or quoted inside SQL."""
    return [o for o in HIT_OUTCOMES if text == o or f"'{o}'" in text]


def test_no_module_but_the_schema_spells_a_hit_outcome() -> None:
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "kvlens" / "schema.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            skip = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                    found += [f"{path.relative_to(ROOT)}:{node.lineno}: {o}" for o in _spellings(node.value)]
    assert not found, "use kvlens.schema's Outcome / HIT_OUTCOMES_SQL:\n" + "\n".join(found)


def test_the_guard_sees_a_literal() -> None:
    assert _spellings("SELECT 1 WHERE outcome IN ('hit_local', 'x')") == ["hit_local"]
    assert _spellings("hit_remote") == ["hit_remote"] and _spellings("hit_remote_tokens") == []
