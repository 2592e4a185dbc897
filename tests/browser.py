"""Headless Chromium for the tests that check what a browser shows (Selenium with Debian's
chromium-driver; `make sysdeps` installs both)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless Chromium and chromium-driver are not installed (make sysdeps installs them)",
)
WAIT_S = 300.0
"""Upper bound for the browser waits: a safety net against a hung page, not a time limit."""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM is not None and CHROMEDRIVER is not None
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1000",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


def wait(driver: Any, condition: Callable[[Any], Any]) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition)
