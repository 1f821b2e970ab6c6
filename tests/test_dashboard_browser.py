"""The real dashboard in headless Chromium: every page loads, draws, and follows the filters.

Starts ``kvlens dashboard`` on the demo's analysis DB as a subprocess and drives Debian's
chromium through selenium and /usr/bin/chromedriver. Screenshots land in the test's tmp_path.
Chromium missing is a failure, not a skip: CI installs it (apt-get install chromium chromium-driver).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from chromium import chrome
from test_dashboard import PAGE_TABLES

from kvlens.dashboards.app import PAGES
from kvlens.dashboards.read import table_rows

pytestmark = pytest.mark.slow

WAIT_S = 45
CHART = '[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg'
EXCEPTION = '[data-testid="stException"]'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"kvlens dashboard exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"kvlens dashboard did not answer at {url} within 60 s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def dashboard(demo_workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("dashboard") / "server.log"
    cmd = [
        sys.executable,
        "-c",
        "from kvlens.cli import main; main()",
        "dashboard",
        "--db",
        str(demo_workdir / "kvlens.duckdb"),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    with log.open("wb") as out:
        # Its own process group: the CLI starts streamlit as a child, and both must stop.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    driver = chrome(tmp_path_factory.mktemp("chromium-profile"), ["--window-size=1400,1100"],
                    "the dashboard browser test")
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: object) -> object:
    """An explicit wait that retries while Streamlit re-renders the elements it looks at."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    ignored = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.2, ignored_exceptions=ignored)


def _settled(want: str) -> object:
    """A wait condition: the page shows ``want`` (CSS), a "no rows yet" note or an exception, no run
    is pending, nothing is stale, and the main area has not changed over the last three polls (the
    elements after the first chart arrive over the websocket after it)."""
    from selenium.webdriver.common.by import By

    seen: list[str] = []

    def check(driver: object) -> bool:
        busy = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"], [data-stale="true"]')
        main = driver.find_element(By.CSS_SELECTOR, '[data-testid="stMain"]')
        shown = (
            bool(driver.find_elements(By.CSS_SELECTOR, EXCEPTION))
            or bool(driver.find_elements(By.CSS_SELECTOR, want))
            or "no rows yet" in main.text
        )
        snapshot = f"{len(main.find_elements(By.CSS_SELECTOR, '[data-testid]'))}:{main.text}"
        seen.append(snapshot if shown and not busy else "")
        return len(seen) >= 3 and seen[-1] != "" and seen[-3:] == [snapshot] * 3

    return check


def _click_nav(driver: object, url_path: str) -> bool:
    from selenium.webdriver.common.by import By

    for link in driver.find_elements(By.CSS_SELECTOR, '[data-testid="stSidebarNavLink"]'):
        if (link.get_attribute("href") or "").rstrip("/").endswith("/" + url_path):
            link.click()
            return True
    return False


def _open(driver: object, url: str, title: str, *, click: str | None = None) -> None:
    """Load ``url``, or with ``click`` follow the sidebar link to that url path (same session)."""
    from selenium.webdriver.common.by import By

    if click is None:
        driver.get(url)
    else:
        _wait(driver).until(lambda d: _click_nav(d, click))
    _wait(driver).until(
        lambda d: any(h.text.startswith(title) for h in d.find_elements(By.CSS_SELECTOR, "h1, h2"))
    )
    _wait(driver).until(_settled(CHART))


def _metric(driver: object, label: str) -> str:
    from selenium.webdriver.common.by import By

    for m in driver.find_elements(By.CSS_SELECTOR, '[data-testid="stMetric"]'):
        shown = m.find_element(By.CSS_SELECTOR, '[data-testid="stMetricLabel"]').text.strip()
        if shown.split(" (")[0] == label:  # "Token hit ratio (modelled)": the label carries the provenance
            return str(m.find_element(By.CSS_SELECTOR, '[data-testid="stMetricValue"]').text)
    raise AssertionError(f"no metric {label!r} on the page")


def _expects_chart(db: Path, page: str, scenario: str) -> bool:
    con = duckdb.connect(str(db), read_only=True)
    try:
        table = PAGE_TABLES[page]
        return bool(table_rows(con.cursor(), table, scenario))
    finally:
        con.close()


def _scenario(driver: object) -> str:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.CSS_SELECTOR, '[data-testid="stSidebar"] [data-testid="stSelectbox"] input')
    return str(box.get_attribute("value"))


def test_every_page_loads_and_draws(
    dashboard: str, browser: object, demo_workdir: Path, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    assert [p.url_path for p in PAGES] == list(PAGE_TABLES)
    for i, spec in enumerate(PAGES):
        # The first page by its URL, the others through the sidebar as an operator would.
        _open(browser, f"{dashboard}/", spec.title, click=None if i == 0 else spec.url_path)
        browser.save_screenshot(str(tmp_path / f"{i:02d}-{spec.url_path}.png"))
        errors = [e.text for e in browser.find_elements(By.CSS_SELECTOR, EXCEPTION)]
        assert not errors, f"{spec.url_path} shows an exception: {errors}"
        if _expects_chart(demo_workdir / "kvlens.duckdb", spec.url_path, _scenario(browser)):
            assert browser.find_elements(By.CSS_SELECTOR, CHART), f"{spec.url_path}: no chart drawn"
        else:
            assert "no rows yet" in browser.find_element(By.CSS_SELECTOR, '[data-testid="stMain"]').text
    assert len(list(tmp_path.glob("*.png"))) == len(PAGES)


def test_scenario_filter_changes_the_numbers(dashboard: str, browser: object, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, f"{dashboard}/", "Overview")
    before_scenario, before = _scenario(browser), _metric(browser, "Token hit ratio")
    browser.find_element(
        By.CSS_SELECTOR, '[data-testid="stSidebar"] [data-testid="stSelectbox"] button'
    ).click()
    options = _wait(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, '[role="option"]'))
    target = next(o for o in options if o.text.strip() and o.text.strip() != before_scenario)
    name = target.text.strip()
    target.click()
    _wait(browser).until(
        lambda d: any(
            h.text.startswith(f"Overview: {name}") for h in d.find_elements(By.CSS_SELECTOR, "h1, h2")
        )
    )
    _wait(browser).until(lambda d: _metric(d, "Token hit ratio") != before)
    _wait(browser).until(_settled(CHART))
    browser.save_screenshot(str(tmp_path / f"overview-{name}.png"))
    assert _scenario(browser) == name
    assert not browser.find_elements(By.CSS_SELECTOR, EXCEPTION)
