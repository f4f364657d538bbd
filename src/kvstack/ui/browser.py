"""Debian's headless Chromium driven by selenium: the browser tests and `kvstack ui
screenshot` use this one set-up.

The browser and its driver are the system's (`apt-get install chromium chromium-driver`);
selenium is told the driver's path, so it never tries to download one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kvstack.errors import KvstackError

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars")


class MissingBrowserError(KvstackError):
    """Chromium, its driver or selenium is not installed."""


def chromium_paths() -> tuple[str, str]:
    """(browser, driver) executables found on PATH."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        raise MissingBrowserError("headless Chromium and its driver are not installed; run "
                                  "`apt-get install chromium chromium-driver` (or `make "
                                  "chromium`)")
    return browser, driver


def chromium_driver(user_data_dir: Path, width: int = 1400, height: int = 1000) -> Any:
    """A selenium WebDriver on a fresh headless Chromium profile in `user_data_dir`, with
    the browser console's messages kept (`driver.get_log("browser")`)."""
    browser, driver = chromium_paths()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as err:
        raise MissingBrowserError("selenium is not installed; pip install 'kvstack[ui]'") \
            from err
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def console_errors(driver: Any) -> list[str]:
    """The browser console's error messages since the last call."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry.get("level") == "SEVERE"]
