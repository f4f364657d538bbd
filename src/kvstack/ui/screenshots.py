"""Pictures of the live view for the docs (docs/ui): some traffic against a running server (a shared
system prompt with several questions, a pinned prefix, a long answer still being generated),
then the page in headless Chromium, a playground question sent twice, and one PNG per view.

Traffic goes through the server's own HTTP API (urllib, no extra client); the browser is
`browser.chromium_driver`'s.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvstack.errors import KvstackError

SYSTEM = ("You are the help desk of a small public library. Answer in two or three plain "
          "sentences. The library opens at nine, closes at six, lends up to ten books for three "
          "weeks, and its reading room has quiet desks and power sockets.")
QUESTIONS = ("When does the library open?", "How many books can I borrow?",
             "Is there somewhere quiet to work?", "How long can I keep a book?")
PINNED = ("Reference card: the catalogue is searchable by title, author and subject; rare "
          "books are read in the reading room only; renewals can be made twice.")
PLAYGROUND_QUESTION = "Can I renew a book that is overdue?"
VIEWS = (("overview.png", None), ("pool.png", "pool-section"), ("tree.png", "tree-section"),
         ("charts.png", "charts-section"), ("playground.png", "playground"))


class ScreenshotError(KvstackError):
    """The page did not reach the state a picture needs."""


def _post(url: str, path: str, body: dict[str, Any], key: str | None) -> Any:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
        headers["x-api-key"] = key
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def make_traffic(url: str, model: str, key: str | None) -> threading.Thread:
    """Requests that give every view something to show; returns the thread of a long answer
    still running (its blocks are 'in use' in the pictures)."""
    for question in QUESTIONS:
        _post(url, "/v1/chat/completions", {
            "model": model, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}, key)
    _post(url, "/v1/messages", {
        "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}],
        "system": [{"type": "text", "text": PINNED, "cache_control": {"type": "ephemeral"}}]}, key)
    long_answer = threading.Thread(target=_post, daemon=True, args=(url, "/v1/completions", {
        "model": model, "prompt": "A short history of public libraries:", "max_tokens": 400,
        "temperature": 0, "ignore_eos": True}, key))
    long_answer.start()
    return long_answer


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception:  # the element may not exist yet
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise ScreenshotError(f"timed out waiting for {what}")


def open_view(driver: Any, url: str, key: str | None) -> None:
    """Load the page (with `key` where the server asks for one) and wait for live data."""
    from selenium.webdriver.common.by import By

    driver.get(url + "/ui")
    driver.execute_script("sessionStorage.clear()")
    driver.get(url + "/ui")
    _wait(lambda: driver.find_element(By.ID, "main").is_displayed() or
          driver.find_element(By.ID, "login").is_displayed(), 60, "the page")
    if driver.find_element(By.ID, "login").is_displayed():
        if not key:
            raise ScreenshotError("the server asks for a key; give --key")
        driver.find_element(By.ID, "key").send_keys(key)
        driver.find_element(By.ID, "login-button").click()
    _wait(lambda: driver.find_element(By.ID, "status").text == "live", 60, "live events")
    _wait(lambda: driver.find_element(By.ID, "pool").get_attribute("data-seq"), 60, "a tick")


def send_playground(driver: Any, question: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "pg-user")
    box.clear()
    box.send_keys(question)
    runs = len(driver.find_elements(By.CSS_SELECTOR, "#pg-history li"))
    driver.find_element(By.ID, "pg-send").click()
    _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#pg-history li")) > runs, 600,
          "the playground's answer")


def _capture(driver: Any, path: Path, element_id: str | None) -> Path:
    """A PNG of the whole page or of one element, through the DevTools protocol: the page is
    laid out at full height first, so nothing depends on the headless window's size."""
    width = 1400
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": int(height), "deviceScaleFactor": 1, "mobile": False})
    driver.execute_script("window.scrollTo(0, 0)")
    if element_id is None:
        clip = {"x": 0, "y": 0, "width": width, "height": int(height)}
    else:
        box = driver.execute_script(
            "const r = document.getElementById(arguments[0]).getBoundingClientRect();"
            "return [r.left + scrollX, r.top + scrollY, r.width, r.height];", element_id)
        clip = dict(zip(("x", "y", "width", "height"), box, strict=True))
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True, "clip": {**clip, "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def take_screenshots(driver: Any, url: str, out: Path, key: str | None = None,
                     model: str | None = None, traffic: bool = True) -> list[Path]:
    """Write one PNG per view into `out`; returns their paths."""
    from selenium.webdriver.common.by import By

    out.mkdir(parents=True, exist_ok=True)
    open_view(driver, url, key)
    if traffic:
        model = model or driver.find_element(By.ID, "model").text
        running = make_traffic(url, model, key)
    send_playground(driver, PLAYGROUND_QUESTION)
    send_playground(driver, PLAYGROUND_QUESTION)  # the second run reads its prompt from cache
    seq = int(driver.find_element(By.ID, "pool").get_attribute("data-seq"))
    _wait(lambda: int(driver.find_element(By.ID, "pool").get_attribute("data-seq")) > seq + 1,
          30, "fresh ticks")
    files = [_capture(driver, out / name, element_id) for name, element_id in VIEWS]
    if traffic:
        running.join(timeout=600)
    return files
