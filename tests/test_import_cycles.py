"""No import circle inside a package: module A importing B that (at any depth, lazily or not) imports A."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every package: a function-level import counts (a circle a reader has to untangle all the same);
# one under ``if TYPE_CHECKING:`` does not (it never runs: the usual way to name a type back).
PACKAGES = ("kvlens", "collector", "analyzers", "dashboards", "gpu_probe", "sample_data")


def _module_names(pkg: str) -> dict[str, Path]:
    base = ROOT / pkg
    out = {}
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join(["kvlens", pkg, *parts] if pkg != "kvlens" else ["kvlens", *parts])] = path
    return out


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _edges(pkg: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports, anywhere in its code."""
    names = _module_names(pkg)
    prefix = "kvlens" if pkg == "kvlens" else f"kvlens.{pkg}"
    edges: dict[str, set[str]] = {m: set() for m in names}
    for module, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for top in tree.body if _is_type_checking(top) for n in ast.walk(top)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` reads the submodule sub when there is one, else pkg itself
                # (a parent package's __init__ runs before any submodule: not an edge of its own)
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in names] or [node.module]
            for t in targets:
                if t in names and t != module and (t == prefix or t.startswith(prefix + ".")):
                    edges[module].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_circle_inside(pkg: str) -> None:
    assert _cycles(_edges(pkg)) == []
