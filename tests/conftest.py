"""Shared fixtures: small hand-written trace files; every test checked for what it leaks."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from leaks import Leaks

# Property tests draw the same examples on every run (`make test`, CI): a red run is
# reproducible and a green one means the same thing twice. HYPOTHESIS_PROFILE=explore draws
# new examples each run (as a developer's search for new failures; pin any it finds as a test).
# No deadline: an example's time is not what these tests assert, and on a busy CI machine the first
# example of a test that compiles a numba kernel took 287 ms, past Hypothesis's default 200 ms
# (test_the_128_bit_sum_is_exact, under stress-ng --cpu 2); speed is the benchmarks' (make bench).
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# Three Mooncake lines: a prompt of exactly 2 blocks, one with a partial tail (and a hash id
# above 2**63, which must survive as UBIGINT), and one sharing the first line's prefix.
MOONCAKE_LINES = [
    {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [10, 11]},
    {"timestamp": 1500, "input_length": 1300, "output_length": 7, "hash_ids": [20, 2**63 + 5, 22]},
    {"timestamp": 2750, "input_length": 1100, "output_length": 9, "hash_ids": [10, 11, 30]},
]


@pytest.fixture(scope="session", autouse=True)
def _process_singletons() -> None:
    """Create, before the first test, what libraries open once per process and keep: vl-convert's
    JavaScript runtime (two socket pairs, for the report's PNG charts). Not a test's leak."""
    import vl_convert

    vl_convert.vegalite_to_svg({"mark": "point", "data": {"values": []}})


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail THIS test (at its teardown) when it leaves a socket, pipe, child process or thread behind,
    instead of a later one where the garbage collector happens to close it (tests/leaks.py)."""
    before = Leaks()
    yield
    leaked = before.check(deadline_s=float(os.environ.get("KVLENS_LEAK_WAIT_S", "10")))
    if leaked:
        before.reap()
        pytest.fail(f"{request.node.nodeid} leaked: " + "; ".join(leaked), pytrace=False)


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """write_jsonl(name, records) -> path; a record that is a str is written as-is (bad lines)."""

    def write(name: str, records: list[object]) -> Path:
        path = tmp_path / name
        text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
        path.write_text(text)
        return path

    return write


@pytest.fixture
def mooncake3(write_jsonl: Callable[..., Path]) -> Path:
    return write_jsonl("trace.jsonl", MOONCAKE_LINES)


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole demo pipeline (sample trace, three what-ifs, analysis DB), built once per session.

    ``demo_workdir / "kvlens.duckdb"`` is the demo's analysis DB; ``demo_workdir / "lake"`` its lake.
    """
    from kvlens.sample_data.demo import run_demo

    workdir = tmp_path_factory.mktemp("demo")
    run_demo(workdir)
    return workdir


@pytest.fixture(scope="module")
def ooc_lakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The lakes the out-of-core tests run on (tests/ooc_harness.py), built once per module."""
    from ooc_harness import ooc_lakes as build

    return build(tmp_path_factory.mktemp("out-of-core"))
