#!/usr/bin/env bash
# GPU probe acceptance check (issue 8), for a session lent a CUDA machine. From the repo root:
#     bash gpu_probe/device_check.sh [--prefix-tokens 4096,16384] [--runs 3]
# Installs nothing and needs no network: it uses the first python among $PYTHON, .venv/bin/python,
# python3, python whose torch sees CUDA. The table, the PASS/FAIL lines and the probe_runs rows
# (JSON) go to stdout and to $OUT (default /tmp/kvlens-probe). Then, when pytest and the spine's
# dependencies are importable, the gpu-marked tests run. Exit: 0 all criteria hold, 1 one fails,
# 2 no CUDA python found.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvlens-probe}"
mkdir -p "$OUT"
export OUT

PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
        PY="$cand"
        break
    fi
done
if [ -z "$PY" ]; then
    echo "device_check: no python with a CUDA-enabled torch (tried \$PYTHON, .venv/bin/python, python3, python)"
    nvidia-smi 2>&1 | head -15 || true
    exit 2
fi
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
          "| cuda", torch.version.cuda, "| cudnn", torch.backends.cudnn.version(), "|", torch.cuda.get_device_name(0))'
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,pcie.link.gen.max,pcie.link.width.max --format=csv 2>/dev/null || true

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The spine imports pyarrow at module level for its lake writer; this check writes no lake, so a
# stand-in module is used when the machine's python lacks pyarrow.
timeout 540 "$PY" - --out "$OUT" "$@" <<'PYEOF'
import runpy, sys, types
try:
    import pyarrow  # noqa: F401
except ImportError:
    shim = types.ModuleType("pyarrow")
    shim.__getattr__ = lambda name: (lambda *args, **kwargs: None)
    sys.modules["pyarrow"] = shim
    print("note: pyarrow missing; a stand-in module lets the spine import (no lake is written)")
sys.argv = ["device_check", *sys.argv[1:]]
runpy.run_module("gpu_probe.device_check", run_name="__main__")
PYEOF
rc=$?
echo "device_check exit status: $rc (outputs in $OUT)"

if "$PY" -c 'import pytest, pyarrow, duckdb, polars, click, msgspec' >/dev/null 2>&1; then
    timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_probe.py 2>&1 | tail -15
else
    echo "gpu-marked tests not run: pytest or a kvlens dependency is missing on this machine"
fi
exit "$rc"
