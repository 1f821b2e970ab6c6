"""One decoder under atheris (libFuzzer, coverage-guided): fuzz_one.py NAME [libFuzzer flags].

The collector and spine modules are instrumented for coverage; each input goes through
``fuzz.harness.check``, and a finding (an exception outside the decoder's error tree, or a poison
row) stops the run as a libFuzzer crash, with the input saved to the regression corpus
(tests/data/fuzz-corpus/NAME/) so that the unit suite replays it from then on. Half the mutations
are libFuzzer's own, half ``fuzz.mutate``'s structure-aware ones (msgpack / JSON / protobuf
values at the edges of their columns).
"""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `fuzz`

import kvlens.collector.hashing  # noqa: F401  numba-compiled: loaded before (so without) instrumentation

# The decoders (kvlens.collector) and the spine (kvlens) are instrumented, not the analysis side.
with atheris.instrument_imports(include=["kvlens", "fuzz"], exclude=[
        "kvlens.analyzers", "kvlens.dashboards", "kvlens.gpu_probe", "kvlens.sample_data"]):
    from fuzz.harness import KINDS, check, save
    from fuzz.mutate import mutate
    from fuzz.targets import protobuf_mutant, seeds

NAME = sys.argv[1]
KIND, PREFIX = KINDS[NAME]
POOL = seeds(NAME)


def test_one(data: bytes) -> None:
    finding = check(NAME, data)
    if finding:
        path = save(NAME, data)
        raise RuntimeError(f"{NAME}: {finding} (saved as {path})")


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.5:
        try:
            out: bytes | None = None
            if NAME == "otlp_protobuf" and rng.random() < 0.5:
                out = protobuf_mutant(data, rng)
            if out is None:
                out = mutate(data, rng, kind=KIND, others=POOL, prefix=PREFIX)
            return out[:max_size]
        except RecursionError:  # an input nested too deep for the mutator itself: mutate bytes instead
            pass
    return bytes(atheris.Mutate(data, max_size))


def main() -> None:
    logging.disable(logging.CRITICAL)  # the decoders log every input they skip
    atheris.Setup([sys.argv[0], *sys.argv[2:]], test_one, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
