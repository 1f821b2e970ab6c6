"""collector's front door for ``kvlens import``: files of any of the seven formats into the lake, one result.

The format registry lives here: the trace-line formats (``importer.py``: one request per line),
the recorded engine frames (``capture.import_capture``) and the OTLP trace files
(``otlp.import_otlp``). The CLI's ``import`` choices and the demo call this module only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

from kvlens.errors import ConfigError, EmptyReplaceError
from kvlens.lake import empty_replace_allowed

__all__ = ["FORMATS", "LINE_FORMATS", "ImportResult", "import_files"]

LINE_FORMATS = ("mooncake", "bailian", "gateway", "lmcache-lookup")
# Every format `kvlens import` takes, in the order its help lists them.
FORMATS: tuple[str, ...] = ("mooncake", "bailian", "gateway", "vllm-events", "lmcache-lookup", "otlp-json",
                            "otlp")


@dataclass(frozen=True)
class ImportResult:
    """What one import wrote and skipped; the counts a format does not have stay 0."""

    format: str
    scenario: str
    files: tuple[str, ...]
    requests: int = 0  # rows of requests (trace lines, llm_request spans)
    blocks: int = 0  # rows of request_blocks (trace lines)
    kv_rows: int = 0  # rows of kv_events (vllm-events)
    batches: int = 0  # event batches imported (vllm-events)
    bad_lines: int = 0
    repeats: int = 0  # repeated lookups of requests already imported (lmcache-lookup)
    bad_frames: int = 0
    bad_events: int = 0
    duplicates: int = 0  # batches whose (replica, seq) was seen before
    unannounced_parents: int = 0  # stores whose parent block was never announced
    other_spans: int = 0  # OTLP spans that are not llm_request spans
    bad_spans: int = 0  # llm_request spans without a request id
    first_bad: tuple[str, ...] = ()

    def summary(self, lake: str | os.PathLike[str]) -> str:
        """The line ``kvlens import`` prints: the counts this kind of format has."""
        where = f"scenario {self.scenario!r} of {lake}"
        if self.format == "vllm-events":
            return (f"imported {self.batches:,} batches and {self.kv_rows:,} kv_events rows into {where} "
                    f"({self.bad_frames:,} bad frames, {self.bad_events:,} bad events, {self.duplicates:,} "
                    f"duplicates skipped; {self.unannounced_parents:,} stores whose parent was never "
                    "announced)")
        if self.format in ("otlp-json", "otlp"):
            return (f"imported {self.requests:,} requests from llm_request spans into {where} "
                    f"({self.other_spans:,} other spans, {self.bad_spans:,} without a request id)")
        return f"imported {self.requests:,} requests and {self.blocks:,} blocks into {where}"


def import_files(fmt: str, paths: Sequence[str | os.PathLike[str]], lake: str | os.PathLike[str], *,
               scenario: str = "default", model: str | None = None, skip_bad_lines: bool = False,
               t0_ns: int | None = None, allow_empty: bool = False,
               on_progress: Callable[[int], None] | None = None) -> ImportResult:
    """Import ``paths`` of format ``fmt`` into ``scenario`` of ``lake``, replacing it whole.

    Files that hold no rows leave the scenario as it was (EmptyReplaceError) unless ``allow_empty``.
    ``on_progress`` (trace-line formats) receives the bytes read since its last call.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown import format {fmt!r}: choose one of {', '.join(FORMATS)}")
    files = tuple(str(p) for p in paths)
    try:
        with empty_replace_allowed() if allow_empty else nullcontext():
            return _import(fmt, files, lake, scenario, model, skip_bad_lines, t0_ns, on_progress)
    except EmptyReplaceError:
        raise EmptyReplaceError(
            f"{', '.join(files)}: no rows read, so nothing was replaced: scenario {scenario!r} of {lake} "
            "keeps its previous rows; check the file(s), or pass --allow-empty to empty the scenario"
        ) from None


def _import(fmt: str, files: tuple[str, ...], lake: str | os.PathLike[str], scenario: str,
            model: str | None, skip_bad_lines: bool, t0_ns: int | None,
            on_progress: Callable[[int], None] | None) -> ImportResult:
    if fmt == "vllm-events":  # frames recorded by `kvlens collect vllm --record` -> kv_events
        from kvlens.collector.capture import import_capture

        c = import_capture(files, lake, scenario=scenario, model=model)
        return ImportResult(fmt, scenario, files, kv_rows=c["rows"], batches=c["batches"],
                            bad_frames=c["bad_frames"], bad_events=c["bad_events"],
                            duplicates=c["duplicates"], unannounced_parents=c["unannounced_parents"])
    if fmt in ("otlp-json", "otlp"):  # OTLP trace files -> requests only (no blocks)
        from kvlens.collector.otlp import import_otlp

        o = import_otlp(fmt, files, lake, scenario=scenario, model=model, skip_bad_lines=skip_bad_lines)
        return ImportResult(fmt, scenario, files, requests=o.requests, other_spans=o.other_spans,
                            bad_spans=o.bad_spans, bad_lines=o.bad_lines, first_bad=tuple(o.first_bad))
    from kvlens.collector.importer import DEFAULT_T0_NS
    from kvlens.collector.importer import import_files as import_lines

    r = import_lines(fmt, files, lake, scenario=scenario, model=model, skip_bad_lines=skip_bad_lines,
                     t0_ns=DEFAULT_T0_NS if t0_ns is None else t0_ns, on_progress=on_progress)
    return ImportResult(fmt, scenario, files, requests=r.requests, blocks=r.blocks, bad_lines=r.bad_lines,
                        repeats=r.repeats, first_bad=tuple(r.first_bad))
