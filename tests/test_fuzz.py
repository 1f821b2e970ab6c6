"""The fuzz harness's deterministic slice in the unit suite, and the regression corpus of every input
that ever failed a decoder (tests/data/fuzz-corpus/<decoder>/); ``make fuzz`` runs the long,
coverage-guided version (tests/fuzz/run.py)."""

from __future__ import annotations

import logging

import pytest
from fuzz.harness import check, corpus, mutants
from fuzz.targets import TARGETS, PoisonRow, seeds

SLICE = 1500  # mutants per decoder: a few seconds each


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)  # decoders log every bad input they skip


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_regression_corpus_stays_inside_the_error_tree(name: str) -> None:
    inputs = corpus(name)
    assert inputs, f"no regression inputs for {name}"
    findings = [(file, f) for file, data in inputs if (f := check(name, data))]
    assert not findings, findings


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seeds_decode_into_rows(name: str) -> None:
    """The real seeds are valid inputs: each decodes, and they yield rows (or the slice tests nothing)."""
    rows = 0
    for data in seeds(name):
        assert check(name, data) is None
        rows += TARGETS[name](data)
    assert rows > 0


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_deterministic_slice_finds_nothing(name: str) -> None:
    findings = [(data[:60], f) for data in mutants(name, SLICE, seed=20260)
                if (f := check(name, data))]
    assert not findings, findings[:5]


def test_a_poison_row_is_a_finding() -> None:
    from fuzz.targets import _check

    from kvlens.schema import REQUESTS

    with pytest.raises(PoisonRow, match="arrival_ns"):
        _check(REQUESTS, [{"request_id": "r", "arrival_ns": 2**63}])
