"""``make fuzz``: every decoder under atheris for FUZZ_RUNS inputs (default 1,000,000), then one table.

Usage: python tests/fuzz/run.py [NAME ...]   (NAME: vllm_events, otlp_protobuf, otlp_json, trace_lines,
prometheus; default all). FUZZ_RUNS, FUZZ_JOBS (parallel decoders, default 2) and FUZZ_SEED tune it.

Each decoder runs in its own process (tests/fuzz/fuzz_one.py), starting from its real seeds and its
regression corpus; its wall time and peak RSS (the child's own, from wait4) are measured here. A
finding stops that decoder's run, is saved to tests/data/fuzz-corpus/NAME/, and makes this exit 1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fuzz.harness import corpus  # noqa: E402
from fuzz.targets import TARGETS, seeds  # noqa: E402


def _start(name: str, work: Path, runs: int, seed: int) -> subprocess.Popen[bytes]:
    start = work / "corpus"
    start.mkdir(parents=True)
    for i, data in enumerate(seeds(name)):
        (start / f"seed-{i:03d}").write_bytes(data)
    for file, data in corpus(name):
        (start / f"regression-{file}").write_bytes(data)
    args = [sys.executable, str(HERE / "fuzz_one.py"), name, f"-runs={runs}", f"-seed={seed}",
            "-max_len=65536", "-rss_limit_mb=4096", f"-artifact_prefix={work}/", "-print_final_stats=1",
            str(start)]
    log = open(work / "log.txt", "wb")  # noqa: SIM115  closed when the child is reaped
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parents[1])


def main(argv: list[str]) -> int:
    names = argv or sorted(TARGETS)
    runs = int(os.environ.get("FUZZ_RUNS", 1_000_000))
    jobs = int(os.environ.get("FUZZ_JOBS", 2))
    seed = int(os.environ.get("FUZZ_SEED", 1))
    results: dict[str, tuple[int, int, float, int, str]] = {}
    with tempfile.TemporaryDirectory(prefix="kvlens-fuzz-") as tmp:
        todo = list(names)
        running: dict[int, tuple[str, Path, float, subprocess.Popen[bytes]]] = {}
        while todo or running:
            while todo and len(running) < jobs:
                name = todo.pop(0)
                work = Path(tmp) / name
                proc = _start(name, work, runs, seed)
                running[proc.pid] = (name, work, time.monotonic(), proc)
                print(f"fuzzing {name} ({runs:,} inputs)", flush=True)
            pid, status, usage = os.wait4(-1, 0)
            if pid not in running:
                continue
            name, work, t0, proc = running.pop(pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
            text = (work / "log.txt").read_text(errors="replace")
            done = re.search(r"Done (\d+) runs", text)
            finding = re.search(r"RuntimeError: (.*)", text)
            results[name] = (proc.returncode, int(done.group(1)) if done else 0, time.monotonic() - t0,
                             usage.ru_maxrss, finding.group(1) if finding else "")
            if proc.returncode:
                print(text[-3000:], file=sys.stderr)
    print(f"\n{'decoder':<15} {'inputs':>11} {'seconds':>8} {'peak RSS MiB':>13}  result")
    failed = 0
    for name in names:
        code, done, secs, rss_kb, finding = results[name]
        ok = code == 0 and done >= runs
        failed += not ok
        print(f"{name:<15} {done:>11,} {secs:>8.0f} {rss_kb / 1024:>13.0f}  "
              f"{'0 findings' if ok else 'FAILED: ' + (finding or f'exit {code}')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
