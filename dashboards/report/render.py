"""Dashboards: the report's pieces (sections, tables, charts) rendered as HTML and as plain text.

Rendering is pure: sections in, text out. The HTML carries its CSS inline and takes each chart's
``src`` from a mapping, so the same page serves email (``cid:``) and a file (``data:`` URIs).
"""

from __future__ import annotations

import html
import struct
from dataclasses import dataclass, field

__all__ = ["Chart", "Lead", "Section", "Table", "png_size", "render_html", "render_text"]


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


@dataclass(frozen=True)
class Chart:
    cid: str
    title: str
    png: bytes

    @property
    def size_px(self) -> tuple[int, int]:
        return png_size(self.png)


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    body: tuple[tuple[str, ...], ...]


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    bullets: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)


@dataclass(frozen=True)
class Lead:
    """The first screen: (element id, sentence) lines, then the actions as (title, effect, basis)."""

    title: str
    lines: tuple[tuple[str, str], ...]
    actions: tuple[tuple[str, str, str], ...]
    note: str = ""


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;color:#222;max-width:760px;
margin:24px auto;padding:0 12px;line-height:1.45}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;border-bottom:1px solid #ddd;padding-bottom:3px;
margin-top:28px}p.meta{color:#666;margin-top:0}table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}th:first-child,td:first-child{text-align:left}
th{background:#f4f4f4}img{max-width:100%;height:auto;display:block;margin:8px 0}li{margin:4px 0}
footer{color:#777;font-size:12px;margin-top:32px}
div.lead{border:1px solid #c9d7e8;background:#f5f9fd;padding:4px 14px 8px;margin:10px 0}
div.lead h2{border:0;margin:8px 0 4px}div.lead p{margin:4px 0}ol.actions{margin:4px 0;padding-left:22px}
ol.actions li{margin:3px 0}span.basis{color:#555;font-size:13px}p.note{color:#666;font-size:12px}
""".strip().replace("\n", "")

_FOOTER = ("Token hit ratio: hit tokens over prompt tokens. Byte hit ratio: hit KV bytes over the KV bytes "
           "of every prompt token. Windows are by request arrival, in UTC.")


def _html_table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in t.body)
    return f"<table><tr>{head}</tr>{body}</table>"


def _html_lead(lead: Lead) -> str:
    lines = "".join(f"<p id=\"{key}\">{html.escape(text)}</p>" for key, text in lead.lines)
    items = "".join(f"<li class=\"action\"><b>{html.escape(t)}</b>: {html.escape(e)} "
                    f"<span class=\"basis\">({html.escape(b)})</span></li>" for t, e, b in lead.actions)
    actions = f"<ol id=\"actions\" class=\"actions\">{items}</ol>" if items else ""
    note = f"<p class=\"note\">{html.escape(lead.note)}</p>" if lead.note else ""
    return f"<div class=\"lead\" id=\"lead\"><h2>{html.escape(lead.title)}</h2>{lines}{actions}{note}</div>"


def render_html(title: str, meta: str, sections: list[Section], src: dict[str, str],
                lead: Lead | None = None) -> str:
    parts = [f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
             f"<p class=\"meta\">{html.escape(meta)}</p>"]
    if lead is not None:
        parts.append(_html_lead(lead))
    for s in sections:
        parts.append(f"<h2>{html.escape(s.title)}</h2>")
        parts += [f"<p>{html.escape(p)}</p>" for p in s.paragraphs]
        if s.bullets:
            parts.append("<ul>" + "".join(f"<li>{html.escape(b)}</li>" for b in s.bullets) + "</ul>")
        parts += [f"<img src=\"{src[c.cid]}\" alt=\"{html.escape(c.title)}\" width=\"{c.size_px[0]}\" "
                  f"height=\"{c.size_px[1]}\">" for c in s.charts]
        parts += [_html_table(t) for t in s.tables]
    parts.append(f"<footer>{html.escape(_FOOTER)}</footer></body></html>\n")
    return "\n".join(parts)


def _text_table(t: Table) -> list[str]:
    cells = [t.header, *t.body]
    widths = [max(len(r[i]) for r in cells) for i in range(len(t.header))]

    def line(r: tuple[str, ...]) -> str:
        pairs = enumerate(zip(r, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs).rstrip()

    return [line(r) for r in cells]


def render_text(title: str, meta: str, sections: list[Section], lead: Lead | None = None) -> str:
    lines = [title, "=" * len(title), meta]
    if lead is not None:
        lines += ["", lead.title, "-" * len(lead.title), *(text for _, text in lead.lines)]
        lines += [f"{i}. {t}: {e} ({b})" for i, (t, e, b) in enumerate(lead.actions, 1)]
        if lead.note:
            lines.append(lead.note)
    for s in sections:
        lines += ["", s.title, "-" * len(s.title)]
        lines += s.paragraphs
        lines += [f"- {b}" for b in s.bullets]
        lines += [f"[chart: {c.title}, {c.size_px[0]}x{c.size_px[1]} px, in the HTML part]" for c in s.charts]
        for t in s.tables:
            lines += ["", *_text_table(t)]
    lines += ["", _FOOTER]
    return "\n".join(lines) + "\n"
