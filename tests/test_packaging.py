"""The wheel installs one top-level package, kvlens, with the data-flow folders inside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kvlens", "collector", "analyzers", "dashboards", "gpu_probe", "sample_data")
SUBPACKAGES = {"collector", "analyzers", "dashboards", "gpu_probe", "sample_data"}


def _source_copy(dest: Path) -> Path:
    """The files a build reads, copied with kvlens/'s symlinks kept, so no build/ lands in the checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in FOLDERS:
        shutil.copytree(ROOT / name, dest / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.mark.slow
def test_the_wheel_has_one_top_level_package(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("kvlens-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"kvlens"}
    second = {n.split("/")[1] for n in names if n.startswith("kvlens/") and n.count("/") >= 2}
    assert second >= SUBPACKAGES
    assert "kvlens/sample_data/conversation_trace.jsonl.gz" in names
    assert "kvlens/dashboards/app.py" in names
    assert "kvlens/dashboards/pages/__init__.py" in names


def test_the_symlinks_point_at_the_folders() -> None:
    for name in SUBPACKAGES:
        link = ROOT / "kvlens" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), f"kvlens/{name}"
