"""Checks on a supervised process tree and an analysis DB, shared by serve's unit test
(tests/test_serve.py) and its live test (tests/integration/test_live_serve.py)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import duckdb

from kvlens.schema import ANALYSIS_TABLES


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc (children of every thread)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += sorted(kids - out)
            out |= kids
    return out


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaps, under a container's init, has ended: it holds nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` (it can be bound again)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def tables(db: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every analysis table's rows, sorted (``scenarios.analyzed_ns``, the wall clock, left out)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        out = {}
        for t in ANALYSIS_TABLES:
            cols = ", ".join(c for c in t.names if c != "analyzed_ns")
            out[t.name] = sorted(con.execute(f"SELECT {cols} FROM {t.name}").fetchall(), key=repr)
        return out
    finally:
        con.close()
