"""The live view in a real browser: Debian's headless Chromium driven by selenium, against a
server in this process (so the test reads the same engine's stats).

One server with two tenants' keys and an admin key, one browser for the module. Tenant A sends
prompts with a marker word; tenant B's page must never show it; the admin's does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from kvstack import LLM
from kvstack.engine.async_llm import AsyncLLM
from kvstack.server.app import ServerConfig, create_app
from kvstack.server.auth import KeyRing, Tenant, tenant_id
from kvstack.server.threaded import ServerThread
from kvstack.ui.browser import chromium_driver, console_errors

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KEY_A, KEY_B, ADMIN = "ui-key-a-0123", "ui-key-b-4567", "ui-admin-89ab"
MARKER = "zebracorn"  # only tenant A's prompts contain it
SYSTEM_A = (f"You are {MARKER}, a helpful assistant for the {MARKER} project. Keep every "
            f"answer short, plain and friendly, and mention {MARKER} when it fits.")
CELL = 12  # px per pool cell for pools up to 2,000 blocks (app.js)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    llm = LLM("smollm2-135m", kv_cache_memory="48MiB")
    engine = AsyncLLM(llm.engine)
    app = create_app(engine, KeyRing([KEY_A, KEY_B], admin_key=ADMIN),
                     ServerConfig(cache_ttl_scale=1.0))
    with ServerThread(app) as url:
        yield {"url": url, "engine": engine, "llm": llm}
    engine.shutdown()
    llm.engine.check_integrity()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    driver = chromium_driver(tmp_path_factory.mktemp("chromium"))
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def wait_for(check: Callable[[], Any], timeout: float = 60, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # an element not there yet, a stale one
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def open_page(driver: Any, url: str, key: str) -> None:
    """A fresh page logged in with `key`, its event stream live."""
    driver.get(url + "/ui")
    driver.execute_script("sessionStorage.clear()")
    driver.get(url + "/ui")
    wait_for(lambda: driver.find_element(By.ID, "login").is_displayed(), what="the key form")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login-button").click()
    wait_for(lambda: driver.find_element(By.ID, "status").text == "live", what="live events")
    seq = int(wait_for(lambda: driver.find_element(By.ID, "pool").get_attribute("data-seq"),
                       what="a first tick"))
    wait_for(lambda: int(driver.find_element(By.ID, "pool").get_attribute("data-seq")) > seq,
             what="a second tick")


def chat(url: str, key: str, system: str, user: str, max_tokens: int = 6) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=300,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "smollm2-135m", "temperature": 0,
                                "max_tokens": max_tokens,
                                "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": user}]})
    assert response.status_code == 200, response.text
    return response.json()


def pinned_message(url: str, key: str, system: str) -> None:
    """An Anthropic request whose system prompt carries cache_control: its blocks get pinned."""
    response = httpx.post(f"{url}/v1/messages", timeout=300, headers={"x-api-key": key},
                          json={"model": "smollm2-135m", "max_tokens": 4,
                                "system": [{"type": "text", "text": system,
                                            "cache_control": {"type": "ephemeral"}}],
                                "messages": [{"role": "user", "content": "Say hi."}]})
    assert response.status_code == 200, response.text


def page_counts(driver: Any) -> dict[str, int]:
    return {name: int(driver.find_element(By.ID, f"count-{name}").text)
            for name in ("free", "in_use", "cached", "pinned", "total")}


def stats_counts(engine: AsyncLLM) -> dict[str, int]:
    s = engine.stats()
    return {"free": s.num_blocks_free - s.num_blocks_cached,
            "in_use": s.num_blocks_used - s.num_blocks_pinned, "cached": s.num_blocks_cached,
            "pinned": s.num_blocks_pinned, "total": s.num_blocks_total}


def playground(driver: Any, user: str, system: str | None = None) -> dict[str, Any]:
    """Send the playground's chat and wait for it: the run's numbers and token classes."""
    if system is not None:
        box = driver.find_element(By.ID, "pg-system")
        box.clear()
        box.send_keys(system)
    box = driver.find_element(By.ID, "pg-user")
    box.clear()
    box.send_keys(user)
    runs = len(driver.find_elements(By.CSS_SELECTOR, "#pg-history li"))
    driver.find_element(By.ID, "pg-send").click()
    wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#pg-history li")) > runs,
             timeout=300, what="the playground run")
    prompt = driver.find_element(By.ID, "pg-prompt-tokens")
    assert prompt.get_attribute("data-state") == "done"
    latest = driver.find_element(By.CSS_SELECTOR, "#pg-history li")
    return {
        "cached": int(latest.get_attribute("data-cached")),
        "total": int(latest.get_attribute("data-total")),
        "classes": driver.execute_script(
            "return [...document.querySelectorAll('#pg-prompt-tokens .tok')]"
            ".map(s => s.className)"),
        "text": prompt.text,
        "answer": driver.find_element(By.ID, "pg-output").text,
        "stats": driver.find_element(By.ID, "pg-stats").text,
    }


def state(url: str, key: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/ui/api/state", headers={"Authorization": f"Bearer {key}"},
                         timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def hover_block(driver: Any, block_id: int) -> str:
    """Move the mouse over a pool cell; the tooltip's text."""
    canvas = driver.find_element(By.ID, "pool")
    width = canvas.size["width"]
    cols = width // CELL
    x = (block_id % cols) * CELL + CELL // 2 - width / 2
    y = (block_id // cols) * CELL + CELL // 2 - canvas.size["height"] / 2
    ActionChains(driver).move_to_element_with_offset(canvas, int(x), int(y)).perform()
    tip = driver.find_element(By.ID, "tooltip")
    wait_for(lambda: tip.get_attribute("data-block") == str(block_id), what="the tooltip")
    return tip.text


def test_page_loads_live_without_console_errors(served: dict[str, Any], browser: Any) -> None:
    open_page(browser, served["url"], KEY_A)
    assert browser.find_element(By.ID, "viewer").text.startswith("tenant: t-")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#charts .chart")) == 8
    total = served["engine"].info.num_kv_blocks
    wait_for(lambda: page_counts(browser)["total"] == total, what="the pool map")
    assert console_errors(browser) == []


def test_pool_map_counts_match_stats(served: dict[str, Any], browser: Any) -> None:
    url, engine = served["url"], served["engine"]
    for question in ("What is a cache?", "Name a colour."):
        chat(url, KEY_A, SYSTEM_A, question)
    pinned_message(url, KEY_A, SYSTEM_A + " Pinned.")
    expected = stats_counts(engine)
    assert expected["cached"] > 0 and expected["pinned"] > 0
    wait_for(lambda: page_counts(browser) == expected, what=f"page counts {expected}")
    assert page_counts(browser) == stats_counts(engine)  # nothing moved meanwhile
    assert console_errors(browser) == []


def test_playground_request_appears_and_a_repeat_is_cached(served: dict[str, Any],
                                                           browser: Any) -> None:
    system = f"You answer for the {MARKER} quiz in one short sentence. Run {uuid.uuid4().hex}."
    first = playground(browser, "Which planet is the largest?", system)
    assert first["cached"] == 0 and first["total"] > 32
    assert set(first["classes"]) == {"tok src-computed"}
    assert "Which planet is the largest?" in first["text"] and first["answer"]
    assert "TTFT" in first["stats"] and "TPOT" in first["stats"]
    second = playground(browser, "Which planet is the largest?")
    assert second["total"] == first["total"]
    assert second["cached"] >= 32 and second["cached"] % 16 == 0
    assert second["classes"][:second["cached"]] == ["tok src-prefix_cache"] * second["cached"]
    assert set(second["classes"][second["cached"]:]) == {"tok src-computed"}
    # The request appears in the prefix tree and in the pool map's hover.
    wait_for(lambda: "Run " in browser.find_element(By.ID, "tree").text and system[-10:] in
             browser.find_element(By.ID, "tree").text, what="the prefix in the tree")
    pool = state(served["url"], KEY_A)["pool"]
    nodes = {n["id"]: n for n in state(served["url"], KEY_A)["tree"]}
    block = next(i for i, n in enumerate(pool["node"])
                 if n >= 0 and system[-10:] in nodes[n]["text"])
    tip = hover_block(browser, block)
    assert system[-10:] in tip and "hits" in tip
    assert console_errors(browser) == []


def test_script_prompt_renders_as_text(served: dict[str, Any], browser: Any) -> None:
    attack = ("<script>window.__xss = 1</script><img src=x onerror=\"window.__xss = 2\"> "
              "is this markup?")
    run = playground(browser, attack, f"You are {MARKER}. Reply briefly.")
    assert "<script>window.__xss = 1</script>" in run["text"]
    assert browser.execute_script("return window.__xss") is None
    assert len(browser.find_elements(By.TAG_NAME, "script")) == 1  # app.js only
    assert browser.find_elements(By.CSS_SELECTOR, "#pg-prompt-tokens img") == []
    # Cached in the tree as text too (the markup fills a whole block of the prompt).
    wait_for(lambda: "<script>" in browser.find_element(By.ID, "tree").text,
             what="the markup in the tree, as text")
    assert browser.find_elements(By.CSS_SELECTOR, "#tree img, #tree script") == []
    assert browser.execute_script("return window.__xss") is None


def test_tenant_b_sees_none_of_tenant_a_text(served: dict[str, Any], browser: Any) -> None:
    url = served["url"]
    assert MARKER in json.dumps(state(url, KEY_A))  # A's prompts are cached right now
    open_page(browser, url, KEY_B)
    assert browser.find_element(By.ID, "viewer").text.startswith("tenant: t-")
    wait_for(lambda: "No cached prefix" in browser.find_element(By.ID, "tree").text,
             what="B's empty tree")
    a_pool = state(url, KEY_A)["pool"]
    a_block = next(i for i, n in enumerate(a_pool["node"]) if n >= 0)
    tip = hover_block(browser, a_block)
    assert "another tenant's block" in tip and MARKER not in tip
    body = browser.execute_script("return document.documentElement.outerHTML")
    assert MARKER not in body
    b_state = json.dumps(state(url, KEY_B))
    assert MARKER not in b_state and set(state(url, KEY_B)["pool"]["owner"]) <= {"o", "-"}
    with httpx.stream("GET", f"{url}/ui/api/events", headers={"x-api-key": KEY_B},
                      timeout=60) as events:
        seen = []
        for line in events.iter_lines():
            seen.append(line)
            if sum(line.startswith("event: tick") for line in seen) >= 2:
                break
    assert MARKER not in "\n".join(seen)
    assert console_errors(browser) == []
    # The admin sees everyone's text, labelled by tenant.
    admin = state(url, ADMIN)
    marked = [n for n in admin["tree"] if MARKER in n["text"]]
    assert marked and {n["tenant"] for n in marked} == {tenant_id(Tenant(KEY_A))}


def test_screenshots_are_written(served: dict[str, Any], browser: Any, tmp_path: Path) -> None:
    from kvstack.ui.screenshots import take_screenshots

    files = take_screenshots(browser, served["url"], tmp_path, key=ADMIN, traffic=False)
    assert [f.name for f in files] == ["overview.png", "pool.png", "tree.png", "charts.png",
                                       "playground.png"]
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 2000
