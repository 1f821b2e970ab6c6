"""The import arrows DESIGN.md draws: a wrong arrow fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvlens", "collector", "analyzers", "dashboards", "gpu_probe", "sample_data")

# package -> top-level modules it must never import, anywhere in its code
FORBIDDEN = {
    "kvlens": {"collector", "analyzers", "dashboards", "gpu_probe", "sample_data", "streamlit", "torch"},
    "collector": {"analyzers", "dashboards", "gpu_probe", "sample_data", "streamlit", "torch"},
    "analyzers": {"collector", "dashboards", "gpu_probe", "sample_data", "streamlit", "torch"},
    "dashboards": {"collector", "gpu_probe", "sample_data", "torch"},
    "gpu_probe": {"collector", "analyzers", "dashboards", "sample_data", "streamlit"},
    "sample_data": {"dashboards", "streamlit", "torch"},
}
# The CLI is the one spine module allowed to reach every package, lazily (inside functions).
LAZY_ONLY = {("kvlens", "cli.py"): {"collector", "analyzers", "dashboards", "gpu_probe", "sample_data"}}
# torch only inside functions, so the package imports without the gpu extra.
MODULE_LEVEL_FORBIDDEN = {"gpu_probe": {"torch"}}


def _layer(module: str) -> str:
    """The layer an imported module belongs to: kvlens.collector.live -> collector, kvlens.lake ->
    kvlens; anything else by its top-level name (an old bare ``collector`` import is caught apart)."""
    parts = module.split(".")
    if parts[0] == "kvlens" and len(parts) > 1 and parts[1] in PACKAGES:
        return parts[1]
    return parts[0]


def _imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """(layer of the imported module, imported at module level) for every import in the tree."""
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # imports under a module-level if/try still run at import time
        if isinstance(node, ast.If | ast.Try):
            top_level |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(_layer(a.name), id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((_layer(node.module), id(node) in top_level))
    return out


def test_import_arrows_point_one_way() -> None:
    wrong = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            lazy_ok = LAZY_ONLY.get((pkg, path.name), set())
            for name, module_level in _imports(ast.parse(path.read_text(), str(path))):
                if name in FORBIDDEN[pkg] and not (name in lazy_ok and not module_level):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
                if module_level and name in MODULE_LEVEL_FORBIDDEN.get(pkg, set()):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name} at module level")
    assert not wrong, "\n".join(wrong)


def test_the_arrow_check_can_fail() -> None:
    bad = ast.parse("import kvlens.analyzers\nfrom kvlens.collector.live import X\nfrom kvlens import lake\n"
                    "def f():\n    import torch\n")
    assert _imports(bad) == [("analyzers", True), ("collector", True), ("kvlens", True), ("torch", False)]


def test_only_the_installed_names_are_imported() -> None:
    """Every import of a data-flow folder goes through kvlens.<folder>: a bare ``import collector``
    works only from the checkout and would load a second copy of the module."""
    bare = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                else:
                    continue
                bare += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                         if n.split(".")[0] in PACKAGES[1:]]
    assert not bare, "\n".join(bare)


def test_every_package_declares_all() -> None:
    for pkg in PACKAGES:
        init = ROOT / pkg / "__init__.py"
        assert "__all__" in init.read_text(), f"{pkg}/__init__.py has no __all__"
