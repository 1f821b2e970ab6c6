"""Runs every benchmark under tests/bench (bench_*.py, each with a ``main() -> list[str]``).

Results are ratios against a baseline measured in the same run, printed as one table.
Usage: python tests/bench/run.py [NAME ...]   (NAME: a bench module without bench_ / .py)
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    wanted = set(argv)
    failed = 0
    for path in sorted(HERE.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        if wanted and name not in wanted:
            continue
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        ok = module.main()
        print(f"   ({time.perf_counter() - t0:.1f} s, target {'met' if ok else 'MISSED'})", flush=True)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
