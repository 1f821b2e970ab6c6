"""Collector's field kit for the trace-line formats: one JSON line's fields -> checked values, one ``Parsed``.

Every format module (mooncake.py, bailian.py, gateway.py, lmcache.py) reads its lines with these
and nothing else of the import driver (importer.py), which in turn only dispatches to them: the
imports point one way. ``checked_lines``, the gzip-aware line reader, is here too, so that the
importer and the OTLP JSON files (otlp.py) read lines the same way without importing each other.
"""

from __future__ import annotations

import gzip
import math
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from kvlens.collector.hashing import U64_MASK, fold_u64
from kvlens.errors import InputError
from kvlens.limits import INT32_MAX, INT64_MAX

__all__ = [
    "MAX_LINE_BYTES", "FieldError", "Parsed", "Parser", "ParserFactory", "checked_lines", "hash_id_request",
    "need_hashes", "need_int", "need_number", "opt_str", "rfc3339_ns", "seconds_ns", "tail_tokens",
]

MAX_LINE_BYTES = 64 << 20  # one request per line: a longer line is not one

_HEX = re.compile(r"(?:0[xX])?[0-9a-fA-F]+")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class FieldError(ValueError):
    """Raised by a format parser: which field of the line is wrong, and how."""

    def __init__(self, field_name: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass
class Parsed:
    """One request and its blocks, as a format parser returns them."""

    request: dict[str, Any]
    block_hashes: Sequence[int]
    block_tokens: Sequence[int]
    block_size_tokens: int
    content_hashes: Sequence[int] | None = None
    namespace: str | None = None
    token_hashes: Sequence[int | None] | None = None  # per block, not chained (token ids known)


def need_int(rec: Any, key: str, *, minimum: int = 0, maximum: int = INT32_MAX) -> int:
    """``rec[key]`` as an int in [minimum, maximum], or a FieldError naming the key.

    The default maximum is the INTEGER column range; times pass ``maximum=INT64_MAX``.
    """
    if not isinstance(rec, dict):
        raise FieldError(None, f"expected a JSON object, got {type(rec).__name__}")
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(key, f"expected an integer, got {value!r:.40}")
    if not minimum <= value <= maximum:
        raise FieldError(key, f"expected an integer in [{minimum}, {maximum}], got {value}")
    return value


def rfc3339_ns(text: str) -> int:
    """An RFC 3339 time with a zone as int ns since the epoch, without float rounding."""
    when = datetime.fromisoformat(text)
    if when.tzinfo is None:
        raise ValueError(f"time without a zone offset: {text!r:.40}; add Z or +00:00")
    delta = when - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000


def need_number(rec: dict[str, Any], key: str) -> float:
    """``rec[key]`` as a finite float >= 0, or a FieldError naming the key."""
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(key, f"expected a number >= 0, got {value!r:.40}")
    try:
        number = float(value)
    except OverflowError:  # an integer past the float range
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise FieldError(key, f"expected a finite number >= 0, got {value!r:.40}")
    return number


def seconds_ns(seconds: float, key: str, *, offset_ns: int = 0, resolution_ns: int = 1) -> int:
    """``offset_ns`` + ``seconds`` as int ns (rounded to ``resolution_ns``), or a FieldError past int64."""
    if seconds * 1e9 > INT64_MAX:
        raise FieldError(key, f"{seconds:g} s is past the int64 nanosecond range (year 2262)")
    ns = offset_ns + round(seconds * (1e9 / resolution_ns)) * resolution_ns
    if not 0 <= ns <= INT64_MAX:
        raise FieldError(key, f"{seconds:g} s gives a time outside the int64 nanosecond range")
    return ns


def need_hashes(rec: dict[str, Any], key: str) -> list[int]:
    """A list of block hashes: ints (signed ones folded to unsigned 64-bit) or hex digests.

    A hex digest longer than 16 digits keeps its last 8 bytes, as vLLM's events do.
    """
    value = rec.get(key)
    if not isinstance(value, list):
        raise FieldError(key, f"expected a list of block hashes, got {value!r:.40}")
    out = []
    for i, h in enumerate(value):
        if isinstance(h, int) and not isinstance(h, bool):
            if not -(2**63) <= h <= U64_MASK:
                raise FieldError(key, f"element {i} does not fit 64 bits: {h}")
            out.append(fold_u64(h))
        elif isinstance(h, str):
            if not _HEX.fullmatch(h):  # int(.., 16) would also take "-1", "+1", "1_0" and spaces
                raise FieldError(key, f"element {i} is not a hex digest: {h!r:.40}")
            out.append(int(h[-16:].removeprefix("0x").removeprefix("0X") or "0", 16))
        else:
            raise FieldError(key, f"element {i} is not an integer or hex string: {h!r:.40}")
    return out


def opt_str(rec: dict[str, Any], key: str) -> str | None:
    value = rec.get(key)
    if value is None:
        return None
    if isinstance(value, str | int) and not isinstance(value, bool):
        return str(value)
    raise FieldError(key, f"expected a string, got {value!r:.40}")


def tail_tokens(prompt_tokens: int, n_blocks: int, block_size: int, key: str) -> list[int]:
    """Tokens per block for ``n_blocks`` covering a prompt: full blocks, then a partial tail.

    ``n_blocks`` may be ceil(prompt/B) (the tail has a hash) or floor(prompt/B) (only full
    blocks are hashed, as engines do); anything else does not describe this prompt.
    """
    full, rest = divmod(prompt_tokens, block_size)
    if n_blocks == full:
        return [block_size] * full
    if rest and n_blocks == full + 1:
        return [block_size] * full + [rest]
    raise FieldError(key, f"{n_blocks} blocks do not fit {prompt_tokens} prompt tokens in "
                          f"blocks of {block_size} (expected {full} or {full + (1 if rest else 0)})")


def hash_id_request(rec: Any, request: dict[str, Any], *, block_tokens: int, namespace: str) -> Parsed:
    """A request of a public trace (Mooncake, Bailian) from ``input_length``, ``output_length``
    and ``hash_ids``: ids already prefix-chained over token content, so they serve as both keys."""
    prompt = need_int(rec, "input_length")
    hashes = need_hashes(rec, "hash_ids")
    request.update(prompt_tokens=prompt, output_tokens=need_int(rec, "output_length"))
    return Parsed(
        request=request,
        block_hashes=hashes,
        content_hashes=hashes,
        block_tokens=tail_tokens(prompt, len(hashes), block_tokens, "hash_ids"),
        block_size_tokens=block_tokens,
        namespace=namespace,
    )


class Parser(Protocol):
    # None: the line repeats a request already parsed (counted in LineImportResult.repeats).
    def __call__(self, rec: Any, *, lineno: int, stem: str) -> Parsed | None: ...


ParserFactory = Callable[..., Parser]  # (*, model, t0_ns) -> Parser


def _lines(path: Path) -> Iterator[tuple[int, bytes, int]]:
    """(line number, stripped line, bytes consumed so far in the file on disk).

    A line longer than MAX_LINE_BYTES is read no further than the limit (the rest is skipped
    up to its newline) and yielded cut, so that the line's decoder refuses it: memory stays bounded.
    """
    with open(path, "rb") as raw, (gzip.open(raw, "rb") if path.suffix == ".gz" else raw) as f:
        lineno = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass
                yield lineno, line, raw.tell()  # not stripped: still past the limit for the decoder
                continue
            yield lineno, line.strip(), raw.tell()


def checked_lines(path: Path) -> Iterator[tuple[int, bytes, int]]:
    """``path``'s lines (plain, or gzip for ``.gz``) as (line number, stripped line, bytes read on
    disk); damaged gzip data is an InputError naming the file and the last whole line."""
    lineno = 0
    try:
        for lineno, line, pos in _lines(path):
            yield lineno, line, pos
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"damaged gzip data after line {lineno} ({e}): re-copy the file",
                         path=str(path)) from None
