"""The fuzz harness shared by ``make fuzz`` (tests/fuzz/run.py) and the unit suite's slice.

``check(name, data)`` runs one input through a decoder's target and says what went wrong, if
anything: an exception outside the decoder's error tree, or a poison row. ``mutants`` yields a
deterministic stream of mutated inputs from the real seeds; ``corpus`` is the regression corpus
(tests/data/fuzz-corpus/<decoder>/): every input that ever failed, replayed by the unit suite.
"""

from __future__ import annotations

import hashlib
import random
import traceback
from collections.abc import Iterator
from pathlib import Path

from fuzz.mutate import mutate
from fuzz.targets import ALLOWED, TARGETS, PoisonRow, protobuf_mutant, seeds

__all__ = ["CORPUS", "KINDS", "check", "corpus", "mutants", "save"]

CORPUS = Path(__file__).resolve().parents[1] / "data" / "fuzz-corpus"
# (structure the mutator may decode, selector bytes before it)
KINDS: dict[str, tuple[str | None, int]] = {
    "vllm_events": ("msgpack", 1), "otlp_protobuf": (None, 0), "otlp_json": ("json", 0),
    "trace_lines": ("json", 1), "prometheus": (None, 0),
}


def check(name: str, data: bytes) -> str | None:
    """None when ``data`` decodes into rows that fit, or fails with the decoder's own error."""
    try:
        TARGETS[name](data)
    except ALLOWED[name]:
        return None
    except PoisonRow as e:
        return f"poison row: {e}"
    except Exception as e:  # a finding: which exception, and where it was raised
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"{type(e).__name__} at {Path(where.filename).name}:{where.lineno}: {str(e)[:120]}"
    return None


def mutants(name: str, n: int, seed: int = 0) -> Iterator[bytes]:
    """``n`` mutated inputs of decoder ``name``, the same for the same seed."""
    rng = random.Random(seed)
    pool = seeds(name)
    kind, prefix = KINDS[name]
    for _ in range(n):
        base = rng.choice(pool)
        if name == "otlp_protobuf" and rng.random() < 0.5:
            out = protobuf_mutant(base, rng)
            if out is not None:
                yield out
                continue
        yield mutate(base, rng, kind=kind, others=pool, prefix=prefix)


def corpus(name: str) -> list[tuple[str, bytes]]:
    """(file name, bytes) of every regression input of decoder ``name``."""
    folder = CORPUS / name
    return [(p.name, p.read_bytes()) for p in sorted(folder.glob("*.bin"))] if folder.is_dir() else []


def save(name: str, data: bytes) -> Path:
    """Add a failing input to the regression corpus (named by its sha1)."""
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (hashlib.sha1(data).hexdigest()[:16] + ".bin")
    path.write_bytes(data)
    return path
