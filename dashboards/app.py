"""Dashboards: the Streamlit entry point (``kvlens dashboard --db FILE`` runs this script).

``streamlit run dashboards/app.py -- --db FILE``: the sidebar's filters are drawn once per
rerun, then the selected page renders from the same cursor and filters.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from kvlens.dashboards.common import Context, cursor, sidebar
from kvlens.dashboards.pages import (
    audit,
    capacity,
    flows,
    hygiene,
    latency,
    misses,
    overview,
    prefixes,
    probe,
    whatif,
)

__all__ = ["DB_ENV", "PAGES", "PageSpec", "main", "run"]

DB_ENV = "KVLENS_DASHBOARD_DB"


@dataclass(frozen=True)
class PageSpec:
    url_path: str
    title: str
    render: Callable[[Context], None]
    icon: str


PAGES: tuple[PageSpec, ...] = (
    PageSpec("overview", "Overview", overview.overview, ":material/dashboard:"),
    PageSpec("misses", "Misses", misses.misses, ":material/search:"),
    PageSpec("prefixes", "Prefixes", prefixes.prefixes, ":material/format_list_numbered:"),
    PageSpec("capacity", "Capacity", capacity.capacity, ":material/storage:"),
    PageSpec("flows", "Flows", flows.flows, ":material/swap_horiz:"),
    PageSpec("latency", "Latency", latency.latency, ":material/timer:"),
    PageSpec("whatif", "What-if", whatif.whatif, ":material/compare:"),
    PageSpec("probe", "Probe", probe.probe, ":material/speed:"),
    PageSpec("audit", "Audit", audit.audit, ":material/policy:"),
    PageSpec("hygiene", "Hygiene", hygiene.hygiene, ":material/cleaning_services:"),
)


def _db_from_argv(argv: list[str]) -> str | None:
    parser = argparse.ArgumentParser(prog="kvlens dashboard", add_help=False)
    parser.add_argument("--db")
    known, _ = parser.parse_known_args(argv)
    return known.db or os.environ.get(DB_ENV)


def run(db: str, only: str | None = None) -> None:
    """Draw the app for ``db``; ``only`` renders one page by url path without navigation (tests)."""
    st.set_page_config(page_title="kvlens", layout="wide")
    path = Path(db)
    if not path.is_file():
        st.error(f"analysis DB {path} does not exist: run kvlens analyze --lake LAKE --db {path} first")
        return
    cur = cursor(str(path.resolve()))
    try:
        ctx = sidebar(cur, str(path))
        if only is not None:
            spec = next(p for p in PAGES if p.url_path == only)
            spec.render(ctx)
            return
        pages = [
            st.Page(_bind(p.render, ctx), title=p.title, url_path=p.url_path, icon=p.icon, default=(i == 0))
            for i, p in enumerate(PAGES)
        ]
        st.navigation(pages).run()
    finally:
        cur.close()


def _bind(render: Callable[[Context], None], ctx: Context) -> Callable[[], None]:
    def page() -> None:
        render(ctx)

    page.__name__ = render.__name__
    return page


def main(argv: list[str] | None = None) -> None:
    db = _db_from_argv(sys.argv[1:] if argv is None else argv)
    if db is None:
        st.error(f"no analysis DB: start with kvlens dashboard --db FILE (or set {DB_ENV})")
        return
    run(db)


if __name__ == "__main__":
    main()
