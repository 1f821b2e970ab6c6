"""Collector driver for trace files: JSONL lines -> ``requests`` and ``request_blocks`` segments.

Each format module parses one decoded line into a request row and its blocks with the field kit
(collector/fields.py, which they import instead of this module: no import circle); this driver
reads the files (plain or gzip, with the kit's ``checked_lines``), names the file, line and field
of a bad line, skips and counts bad lines when asked, and writes both tables with
``replace=True`` so a rerun of the same scenario replaces it whole. An import that stops
half-way (an error, a kill) commits nothing: the scenario's previous rows stay as they were.

A line is bad (named, or counted and skipped with ``--skip-bad-lines``) when it is not JSON,
nests deeper than the decoder's recursion limit, is longer than ``MAX_LINE_BYTES``, or holds a
value its row cannot (kvlens.limits: a time past int64 nanoseconds, a non-finite number, a
hash that is not an unsigned 64-bit value): ``decode_line`` checks every row before it is
buffered, so one such line never fails the writer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvlens.collector.fields import (
    MAX_LINE_BYTES,
    FieldError,
    Parsed,
    Parser,
    ParserFactory,
    checked_lines,
    rfc3339_ns,
)
from kvlens.errors import ConfigError, InputError
from kvlens.lake import SegmentWriter, commit_together
from kvlens.limits import fits, ints_fit, row_problem
from kvlens.schema import REQUEST_BLOCKS, REQUESTS

# MAX_LINE_BYTES, FieldError and rfc3339_ns come from the field kit (collector/fields.py), kept here too.
__all__ = [
    "DEFAULT_T0_NS", "FORMATS", "MAX_LINE_BYTES", "FieldError", "LineImportResult", "Parsed", "decode_line",
    "import_files", "rfc3339_ns",
]

log = logging.getLogger(__name__)

# Traces with relative times (Mooncake ms, Bailian s) are anchored here unless --t0 is given:
# 2025-01-01T00:00:00Z, fixed so that re-imports and reports are reproducible.
DEFAULT_T0_NS = 1_735_689_600 * 1_000_000_000
_BATCH_REQUESTS = 20_000
_BLOCK_COLUMNS = ("position", "block_hash", "content_hash", "token_hash", "block_tokens",
                  "block_size_tokens")


def _formats() -> dict[str, ParserFactory]:
    from kvlens.collector import bailian, gateway, lmcache, mooncake

    return {"mooncake": mooncake.parser, "bailian": bailian.parser, "gateway": gateway.parser,
            "lmcache-lookup": lmcache.parser}


FORMATS: tuple[str, ...] = ("mooncake", "bailian", "gateway", "lmcache-lookup")


@dataclass
class LineImportResult:
    format: str
    scenario: str
    files: list[str]
    requests: int = 0
    blocks: int = 0
    bad_lines: int = 0
    repeats: int = 0
    first_bad: list[str] = field(default_factory=list)


class _Columns:
    """Accumulates requests and blocks as columns, flushing them to the two writers."""

    def __init__(self, requests: SegmentWriter, blocks: SegmentWriter) -> None:
        self.requests, self.blocks = requests, blocks
        self.req_rows: list[dict[str, Any]] = []
        self.cols: dict[str, list[Any]] = {
            k: [] for k in ("request_id", "arrival_ns", *_BLOCK_COLUMNS, "namespace")
        }

    def add(self, p: Parsed) -> int:
        r = p.request
        n = len(p.block_hashes)
        c = self.cols
        c["request_id"].extend([r["request_id"]] * n)
        c["arrival_ns"].extend([r["arrival_ns"]] * n)
        c["position"].extend(range(n))
        c["block_hash"].extend(p.block_hashes)
        c["content_hash"].extend(p.content_hashes if p.content_hashes is not None else [None] * n)
        c["token_hash"].extend(p.token_hashes if p.token_hashes is not None else [None] * n)
        c["block_tokens"].extend(p.block_tokens)
        c["block_size_tokens"].extend([p.block_size_tokens] * n)
        c["namespace"].extend([p.namespace] * n)
        self.req_rows.append(r)
        if len(self.req_rows) >= _BATCH_REQUESTS:
            self.flush()
        return n

    def flush(self) -> None:
        if self.req_rows:
            self.requests.append_rows(self.req_rows)
            self.blocks.append_columns(self.cols)
        self.req_rows = []
        self.cols = {k: [] for k in self.cols}


def import_files(
    fmt: str,
    paths: Sequence[str | os.PathLike[str]],
    lake: str | os.PathLike[str],
    *,
    scenario: str = "default",
    model: str | None = None,
    skip_bad_lines: bool = False,
    t0_ns: int = DEFAULT_T0_NS,
    on_progress: Callable[[int], None] | None = None,
) -> LineImportResult:
    """Import trace files of one format into ``scenario`` of ``lake``, replacing it.

    ``on_progress`` receives the bytes read from disk since its last call.
    """
    factories = _formats()
    if fmt not in factories:
        raise ConfigError(f"unknown import format {fmt!r}: choose one of {', '.join(FORMATS)}")
    files = [Path(p) for p in paths]
    for p in files:
        if not p.is_file():
            raise InputError("no such file: check the path", path=str(p))
    parse = factories[fmt](model=model, t0_ns=t0_ns)
    result = LineImportResult(fmt, scenario, [str(p) for p in files])
    decoder = msgspec.json.Decoder()
    writer_id = f"import-{fmt}"
    rw = SegmentWriter(lake, "requests", scenario=scenario, writer_id=writer_id, replace=True)
    bw = SegmentWriter(lake, "request_blocks", scenario=scenario, writer_id=writer_id, replace=True)
    try:
        cols = _Columns(rw, bw)
        for path in files:
            _read_file(path, parse, decoder, cols, result, skip_bad_lines, on_progress)
        cols.flush()
        commit_together(rw, bw)  # both tables or neither
    except BaseException:
        rw.abort()
        bw.abort()
        raise
    log.info("imported %d requests, %d blocks into scenario %s (%d bad lines)",
             result.requests, result.blocks, scenario, result.bad_lines)
    return result


def _read_file(path: Path, parse: Parser, decoder: msgspec.json.Decoder[Any], cols: _Columns,
               result: LineImportResult, skip_bad_lines: bool,
               on_progress: Callable[[int], None] | None) -> None:
    done = 0
    stem = path.name.split(".")[0]
    for lineno, line, pos in checked_lines(path):
        if on_progress and pos != done:
            on_progress(pos - done)
            done = pos
        if not line:
            continue
        try:
            parsed = decode_line(parse, decoder, line, lineno=lineno, stem=stem)
        except FieldError as e:
            _bad_line(result, path, lineno, line, e, skip_bad_lines)
            continue
        if parsed is None:
            result.repeats += 1
            continue
        result.blocks += cols.add(parsed)
        result.requests += 1


def decode_line(parse: Parser, decoder: msgspec.json.Decoder[Any], line: bytes, *, lineno: int,
                stem: str) -> Parsed | None:
    """One line as a request and its blocks (None: a repeat); FieldError for a bad line."""
    if len(line) > MAX_LINE_BYTES:
        raise FieldError(None, f"line of {len(line):,} bytes is longer than the limit of {MAX_LINE_BYTES:,}")
    try:
        rec = decoder.decode(line)
    except msgspec.DecodeError as e:
        raise FieldError(None, f"not valid JSON ({e})") from None
    except RecursionError:
        raise FieldError(None, "JSON nests deeper than the decoder's recursion limit") from None
    parsed = parse(rec, lineno=lineno, stem=stem)
    if parsed is not None:
        _check_rows(parsed)
    return parsed


_BLOCK_CHECKS = ((REQUEST_BLOCKS.column("block_hash"), "block_hashes"),
                 (REQUEST_BLOCKS.column("content_hash"), "content_hashes"),
                 (REQUEST_BLOCKS.column("token_hash"), "token_hashes"),
                 (REQUEST_BLOCKS.column("block_tokens"), "block_tokens"))


def _check_rows(p: Parsed) -> None:
    """FieldError unless every value of the request and of its blocks fits its column."""
    problem = row_problem(REQUESTS, p.request)
    if problem:
        raise FieldError(problem.split(" ", 1)[0], problem)
    if len(p.block_tokens) != len(p.block_hashes):
        raise FieldError("block_hashes", f"{len(p.block_hashes)} hashes for {len(p.block_tokens)} blocks")
    for column, attr in _BLOCK_CHECKS:
        values = getattr(p, attr)
        if values is not None and not ints_fit(column, values):
            bad = next(v for v in values if not fits(column, v))
            raise FieldError(column.name,
                             f"{bad!r:.40} does not fit request_blocks.{column.name} ({column.type})")
    if not (fits(REQUEST_BLOCKS.column("block_size_tokens"), p.block_size_tokens)
            and fits(REQUEST_BLOCKS.column("namespace"), p.namespace)):
        raise FieldError("block_size", f"block size {p.block_size_tokens!r:.40} or namespace does not fit")


def _bad_line(result: LineImportResult, path: Path, lineno: int, line: bytes, err: Exception,
              skip: bool) -> None:
    field_name = err.field if isinstance(err, FieldError) else None
    message = str(err)
    if not skip:
        raise InputError(f"{message}; fix the line or pass --skip-bad-lines",
                         path=str(path), line=lineno, field=field_name)
    result.bad_lines += 1
    where = f"{path}:{lineno}" + (f" field {field_name!r}" if field_name else "")
    if len(result.first_bad) < 5:
        result.first_bad.append(f"{where}: {message}")
    log.warning("skipped bad line %s: %s; starts %r", where, message, line[:80])
