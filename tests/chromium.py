"""Headless Debian Chromium under Selenium for the browser tests (the dashboard's, the report's)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = ("/usr/bin/chromedriver",)
# What this machine's closed network needs: no background connections, no first-run work.
QUIET = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run")


def _first(paths: tuple[str, ...], which: str) -> str | None:
    return next((p for p in paths if os.access(p, os.X_OK)), None) or shutil.which(which)


def chrome(profile: Path, extra: Sequence[str], purpose: str) -> Any:
    """A Chrome WebDriver on Debian's chromium with ``QUIET`` and ``extra`` flags and a fresh
    profile in ``profile``; fails the test (naming ``purpose``) when chromium is not installed."""
    chromium, driver_path = _first(CHROMIUM, "chromium"), _first(CHROMEDRIVER, "chromedriver")
    if chromium is None or driver_path is None:
        pytest.fail(f"{purpose} needs Debian's chromium and chromedriver: apt-get install chromium "
                    f"chromium-driver (found chromium={chromium}, chromedriver={driver_path})")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (*QUIET, *extra):
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={profile}")
    return webdriver.Chrome(service=Service(driver_path), options=options)
