"""The report's first screen in headless Chromium: what an operator sees before scrolling.

The demo's report (the self-contained file and the email's HTML part) is opened at 1280x800 in
Debian's chromium through selenium; the screenshot lands in the test's tmp dir and its path is in
every failure message. Positions come from getBoundingClientRect, not pixels: the headline, the
change, the avoidable worth and three actions, each with a number, lie above the first chart and
inside the window.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from email import message_from_bytes
from email.policy import default as default_policy
from pathlib import Path

import pytest
from chromium import chrome

from kvlens.dashboards.report import Report, build_report, parse_duration_ns
from kvlens.dashboards.report.mail import build_message

pytestmark = pytest.mark.slow

WIDTH, HEIGHT = 1280, 800
DEMO_NOW_NS = 1_735_693_137 * 10**9  # as tests/test_report.py's golden window

# One JS call: the rectangles of the first screen's parts and of the first chart, in CSS pixels.
MEASURE_JS = """
const box = e => {
  const r = e.getBoundingClientRect(); return {top: r.top, bottom: r.bottom, text: e.innerText};
};
const one = id => { const e = document.getElementById(id); return e ? box(e) : null; };
const img = document.querySelector('img');
return {headline: one('headline'), change: one('change'), avoidable: one('avoidable'),
        actions: Array.from(document.querySelectorAll('#actions li.action')).map(box),
        chart: img ? box(img) : null, viewport: window.innerHeight, width: window.innerWidth};
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    d = chrome(tmp_path_factory.mktemp("chromium-profile"), ["--hide-scrollbars"], "the first-screen test")
    try:
        d.set_window_size(WIDTH, HEIGHT)
        # The window's outer size includes nothing in headless mode, but check what the page gets.
        inner = d.execute_script("return [window.innerWidth, window.innerHeight]")
        if inner != [WIDTH, HEIGHT]:  # some builds keep a frame: grow the window by the difference
            d.set_window_size(2 * WIDTH - inner[0], 2 * HEIGHT - inner[1])
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def demo_report(demo_workdir: Path) -> Report:
    return build_report(demo_workdir / "kvlens.duckdb", since_ns=parse_duration_ns("30m"), now_ns=DEMO_NOW_NS,
                        usd_per_gpu_hour=2.5)


def _email_html(report: Report) -> str:
    msg = build_message(report, sender="kvlens@localhost", recipients=["ops@example.com"])
    parsed = message_from_bytes(msg.as_bytes(), policy=default_policy)
    part = next(p for p in parsed.walk() if p.get_content_type() == "text/html")
    return str(part.get_content())


def _first_screen(driver: object, html: str, where: Path) -> None:
    page = where / "report.html"
    page.write_text(html, encoding="utf-8")
    driver.get(page.as_uri())  # type: ignore[attr-defined]
    shot = where / "first_screen.png"
    driver.save_screenshot(str(shot))  # type: ignore[attr-defined]
    got = driver.execute_script(MEASURE_JS)  # type: ignore[attr-defined]
    see = f"(screenshot: {shot})"
    assert (got["width"], got["viewport"]) == (WIDTH, HEIGHT), f"the window is not 1280x800: {got} {see}"
    assert got["chart"] is not None, f"the report has no chart to be above {see}"
    fold = min(got["chart"]["top"], got["viewport"])
    for part in ("headline", "change", "avoidable"):
        assert got[part] is not None, f"no #{part} on the page {see}"
        assert got[part]["bottom"] <= fold, f"#{part} ends at {got[part]['bottom']}, below {fold} {see}"
        assert re.search(r"\d", got[part]["text"]), f"#{part} has no number: {got[part]['text']!r} {see}"
    assert "token hit ratio" in got["headline"]["text"] and "pts" in got["change"]["text"], see
    assert "GPU-h" in got["avoidable"]["text"] and "$" in got["avoidable"]["text"], see
    assert len(got["actions"]) == 3, f"{len(got['actions'])} actions, not three {see}"
    for i, act in enumerate(got["actions"], 1):
        assert act["bottom"] <= fold, f"action {i} ends at {act['bottom']}, below {fold} {see}"
        assert re.search(r"[+-−]?\d", act["text"].split(":", 1)[1]), f"action {i} has no number {see}"
    assert shot.stat().st_size > 0, see


def test_the_reports_first_screen_holds_the_decision(driver: object, demo_report: Report,
                                                     tmp_path: Path) -> None:
    _first_screen(driver, demo_report.file_html, tmp_path)


def test_the_emails_first_screen_is_the_same(driver: object, demo_report: Report, tmp_path: Path) -> None:
    html = _email_html(demo_report)
    assert 'id="lead"' in html and 'src="cid:' in html
    _first_screen(driver, html, tmp_path)
