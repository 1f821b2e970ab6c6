"""The leak check (tests/leaks.py, tests/conftest.py) fails the test that leaks, not a later one.

An inner pytest run over a module whose first test leaks a socket in a reference cycle (only the
garbage collector frees it) and whose second test collects garbage: without the check the second,
innocent test fails on the ResourceWarning; with it the first fails at its teardown, by name.
Child processes and threads left running are named the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

_INNER = '''
import gc, socket, subprocess, sys, threading

def test_leaks_a_socket():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    cycle = [s]
    cycle.append(cycle)  # unreachable after the test, freed only by a collection

def test_innocent():
    gc.collect()

def test_leaks_a_child():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

def test_leaks_a_thread():
    threading.Thread(target=threading.Event().wait, args=(120,), name="forgotten", daemon=True).start()

def test_clean():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
'''


def _inner_run(tmp_path: Path, *, with_check: bool, only: str = "") -> str:
    (tmp_path / "test_inner.py").write_text(_INNER)
    if with_check:
        shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
        shutil.copy(TESTS / "leaks.py", tmp_path / "leaks.py")
    env = {**os.environ, "KVLENS_LEAK_WAIT_S": "1", "PYTHONPATH": str(TESTS.parent)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-W", "error", "-p", "no:cacheprovider",
                           "-p", "no:randomly", "test_inner.py", *(["-k", only] if only else [])],
                          cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def test_without_the_check_an_innocent_test_takes_the_blame(tmp_path: Path) -> None:
    # (only these two: without the check nothing would end the leaked child)
    out = _inner_run(tmp_path, with_check=False, only="socket or innocent")
    assert "FAILED test_inner.py::test_innocent" in out, out
    assert "PASSED test_inner.py::test_leaks_a_socket" in out, out


def test_the_check_names_the_test_that_leaked(tmp_path: Path) -> None:
    out = _inner_run(tmp_path, with_check=True)
    assert "PASSED test_inner.py::test_innocent" in out, out
    assert "PASSED test_inner.py::test_clean" in out, out
    for name, what in (("test_leaks_a_socket", "unclosed <socket.socket"),
                       ("test_leaks_a_child", "child process"),
                       ("test_leaks_a_thread", "thread 'forgotten'")):
        assert f"ERROR test_inner.py::{name}" in out, out
        assert f"test_inner.py::{name} leaked: " in out and what in out, out
    assert "time.sleep(120)" in out  # the child is named by its command line (and was killed)
