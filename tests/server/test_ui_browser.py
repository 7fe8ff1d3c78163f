"""The /ui playground in a real browser: headless Chromium (a system install) driven by
Playwright against real `plait serve --ui` subprocesses on the default model.

Opt-in by availability: skipped, with the reason, when the `playwright` package or a
Chromium binary is missing (`make test-ui` installs both and runs this file, with
PLAIT_UI_REQUIRE=1, which turns that skip into a failure). Every test
also checks that the page logged no console error, threw nothing and requested nothing
from another origin.

Set PLAIT_UI_UPDATE_SCREENSHOT=1 to write the README's screenshot, docs/ui-playground.png;
otherwise it goes to the test's tmp_path, so that a test run leaves the checkout as it was.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.browser import OBSERVE_JS, PageWatch, choices, launch, skip_reason, sse_chunks
from helpers.paths import REPO
from helpers.server import RemoteServer, start_server, wait_for

_reason = skip_reason()
if _reason and os.environ.get("PLAIT_UI_REQUIRE"):  # `make test-ui`: a skip is a failure
    pytest.fail(f"browser tests required but cannot run: {_reason}", pytrace=False)
if _reason:
    pytest.skip(_reason, allow_module_level=True)

from playwright.sync_api import Page, sync_playwright  # noqa: E402

ROOT = REPO
SCREENSHOT = ROOT / "docs" / "ui-playground.png"
KEY = "secret"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
PROMPT = "Write a short poem about a lighthouse keeper and the sea."


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, RemoteServer]]:
    """Two `plait serve --ui` on the default model, started together: one open, one that
    needs the API key KEY."""
    started = {"open": start_server(["--ui"]),
               "keyed": start_server(["--ui", "--api-key", KEY], api_key=KEY)}
    try:
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def server(servers: dict[str, RemoteServer]) -> RemoteServer:
    return servers["open"]


@pytest.fixture(scope="module")
def keyed_server(servers: dict[str, RemoteServer]) -> RemoteServer:
    return servers["keyed"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_playwright() as playwright:
        try:
            browser = launch(playwright)
        except Exception as error:  # e.g. a distribution's stub that only points to a snap
            if os.environ.get("PLAIT_UI_REQUIRE"):
                raise
            pytest.skip(f"Chromium does not start here: {str(error)[:300]}")
        yield browser
        browser.close()


def _open(browser: Any, server: RemoteServer, viewport: dict[str, int]):
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    page.set_default_timeout(20_000)
    watch = PageWatch(page, server.url)
    return context, page, watch


@pytest.fixture
def ui(browser: Any, server: RemoteServer) -> Iterator[tuple[Page, PageWatch]]:
    """A fresh 1280x800 page on the server's /ui; fails the test on console errors, page
    errors or requests to another origin."""
    context, page, watch = _open(browser, server, DESKTOP)
    response = page.goto(f"{server.url}/ui")
    assert response is not None and response.status == 200
    yield page, watch
    context.close()
    assert not watch.problems(), watch.problems()


# ---------------------------------------------------------------- page actions
def fill(page: Page, prompt: str, **fields: Any) -> None:
    """Type the prompt and the named inputs (n, max_tokens, temperature, seed, ...)."""
    for name, value in fields.items():
        field = page.locator(f"input[name={name}]")
        if field.get_attribute("type") == "range":  # fill() refuses sliders
            field.evaluate("(e, v) => { e.value = v; e.dispatchEvent(new Event('input', "
                           "{bubbles: true})); e.dispatchEvent(new Event('change', "
                           "{bubbles: true})); }", str(value))
        else:
            field.fill(str(value))
    page.fill("textarea[name=prompt]", prompt)


def send(page: Page, prompt: str, **fields: Any) -> None:
    fill(page, prompt, **fields)
    page.click("button[type=submit]")


def wait_finished(page: Page, n: int, timeout_ms: int = 30_000) -> list[dict[str, Any]]:
    page.wait_for_function(
        """n => { const els = document.querySelectorAll('[data-choice]');
                  return els.length === n &&
                    [...els].every(e => e.hasAttribute('data-finish-reason')); }""",
        arg=n, timeout=timeout_ms)
    return choices(page)


def running(server: RemoteServer) -> float:
    return server.metrics()["plait_num_requests_running"]


def prompt_tokens(server: RemoteServer, body: dict[str, Any]) -> int:
    """usage.prompt_tokens of the page's request, asked again with one token and no stream."""
    probe = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    probe.update(n=1, max_tokens=1)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=probe,
                          headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


# ---------------------------------------------------------------- tests
def test_four_choices_stream_side_by_side(ui, server: RemoteServer, tmp_path: Path) -> None:
    page, watch = ui
    headers = httpx.get(f"{server.url}/ui").headers
    assert "content-security-policy" in headers, headers
    fill(page, PROMPT, n=4, max_tokens=48, temperature=0.8, seed=7)
    page.evaluate(OBSERVE_JS)
    page.click("button[type=submit]")
    final = wait_finished(page, 4)

    # Every state the page went through: two columns had text before any had finished.
    log = page.evaluate("window.__plaitChoiceLog")
    assert any(s["withText"] >= 2 and s["finished"] == 0 for s in log), log
    assert [c["index"] for c in final] == [0, 1, 2, 3]
    assert all(c["finish"] in ("stop", "length") for c in final), final
    assert all(c["text"] for c in final), final

    # The request the page sent, and what the server streamed back for it.
    assert len(watch.chat_bodies) == 1, watch.chat_bodies
    body = watch.chat_bodies[0]
    assert body["n"] == 4 and body["stream"] is True and body["max_tokens"] == 48
    assert body["seed"] == 7 and body["temperature"] == 0.8
    assert body["stream_options"]["include_usage"] is True
    assert body["messages"][-1] == {"role": "user", "content": PROMPT}
    chunks = sse_chunks(watch.chat_responses[0].body())
    streamed = {i: "" for i in range(4)}
    finish = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    usage = chunks[-1]["usage"]
    # Each column holds exactly its choice's text, and its finish reason.
    assert [c["text"] for c in final] == [streamed[i] for i in range(4)]
    assert [c["finish"] for c in final] == [finish[i] for i in range(4)]

    # The shared line states the prompt tokens, counted once for the 4 choices.
    assert usage["prompt_tokens"] == prompt_tokens(server, body)
    shared = page.inner_text("[data-role=shared]")
    assert str(usage["prompt_tokens"]) in shared, shared
    assert str(4 * usage["prompt_tokens"]) not in shared, shared

    # The ops strip has been filled from /metrics.
    page.wait_for_function(
        "() => document.querySelector('[data-role=ops]').textContent.trim().length > 0")

    # The screenshot for the README: the ops strip back at rest, the settings folded away
    # so that the columns show.
    page.wait_for_function(
        r"() => /running\s*0\b/.test(document.querySelector('[data-role=ops]').textContent)")
    for summary in page.locator("details[open] > summary").all():
        summary.click()
    shot = tmp_path / "ui-playground.png"
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 10_000
    if os.environ.get("PLAIT_UI_UPDATE_SCREENSHOT"):
        shutil.copyfile(shot, SCREENSHOT)

    # "copy as curl" / "copy as openai-python" show the request just sent.
    page.click("button[name=copy_curl]")
    copied = page.locator("pre[data-role=copy-output]")
    page.wait_for_function(
        "() => document.querySelector('pre[data-role=copy-output]').textContent.includes('curl')")
    assert "/v1/chat/completions" in copied.text_content()
    page.click("button[name=copy_python]")
    page.wait_for_function(
        "() => document.querySelector('pre[data-role=copy-output]')"
        ".textContent.includes('openai')")
    assert "chat.completions.create" in copied.text_content(), copied.text_content()


def test_stop_mid_stream_frees_the_running_requests(ui, server: RemoteServer) -> None:
    page, _ = ui
    assert wait_for(lambda: running(server) == 0, 30)
    send(page, PROMPT, n=2, max_tokens=400, temperature=0.8, seed=3)
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-choice]')]"
        ".some(e => e.textContent.length > 0)")
    assert running(server) > 0  # 400 tokens take far longer than this
    page.click("button[name=stop]")
    assert wait_for(lambda: running(server) == 0, 30, interval=0.1), server.metrics()
    metrics = server.metrics()
    assert metrics["plait_num_requests_waiting"] == 0
    assert metrics["plait_kv_blocks_used"] == 0, metrics
    # The unfinished columns say so: the stream really was cut.
    final = wait_finished(page, 2, timeout_ms=30_000)
    assert "abort" in [c["finish"] for c in final], final


def test_api_key_wrong_then_right(browser: Any, keyed_server: RemoteServer) -> None:
    context, page, watch = _open(browser, keyed_server, DESKTOP)
    # Chromium's own log line for any 401 (the chat request, /v1/models, /metrics polls).
    watch.allow(r"status of 401")
    try:
        assert page.goto(f"{keyed_server.url}/ui").status == 200  # the page itself is open
        page.fill("input[name=api_key]", "wrong-key")
        send(page, "Hello", n=2, max_tokens=8)
        error = page.locator("[data-role=error]")
        error.wait_for(state="visible")
        assert "api key" in error.inner_text().lower(), error.inner_text()

        page.fill("input[name=api_key]", KEY)
        send(page, "Hello", n=2, max_tokens=8)
        final = wait_finished(page, 2)
        assert any(c["text"] for c in final), final
        assert watch.chat_bodies and len(watch.chat_bodies) == 2
        # Kept in sessionStorage (this tab only), never in localStorage.
        session = page.evaluate("() => Object.values(sessionStorage)")
        local = page.evaluate("() => Object.values(localStorage)")
        assert any(KEY in v for v in session), session
        assert not any(KEY in v for v in local), local
    finally:
        context.close()
    assert not watch.problems(), watch.problems()


def test_continue_from_choice_2(ui, server: RemoteServer) -> None:
    page, watch = ui
    send(page, "Name a colour.", n=3, max_tokens=16, temperature=0.8, seed=11)
    first = wait_finished(page, 3)
    chosen = first[2]["text"]
    assert chosen, first
    page.click('button[data-continue="2"]')

    # Keyboard: Shift+Enter is a new line, Enter sends.
    prompt = page.locator("textarea[name=prompt]")
    prompt.fill("")
    prompt.type("Why that one?")
    prompt.press("Shift+Enter")
    prompt.type("Answer briefly.")
    assert prompt.input_value() == "Why that one?\nAnswer briefly."
    assert len(watch.chat_bodies) == 1  # Shift+Enter sent nothing
    prompt.press("Enter")
    assert wait_for(lambda: len(watch.chat_bodies) == 2, 30), watch.chat_bodies
    wait_finished(page, 3)

    messages = watch.chat_bodies[1]["messages"]
    assert messages[-2:] == [{"role": "assistant", "content": chosen},
                             {"role": "user", "content": "Why that one?\nAnswer briefly."}]
    assert {"role": "user", "content": "Name a colour."} in messages[:-2], messages


def test_phone_width_stacks_the_columns(browser: Any, server: RemoteServer,
                                        tmp_path: Path) -> None:
    context, page, watch = _open(browser, server, PHONE)
    try:
        assert page.goto(f"{server.url}/ui").status == 200
        send(page, PROMPT, n=4, max_tokens=16, temperature=0.8, seed=5)
        wait_finished(page, 4)
        boxes = [page.locator(f'[data-choice="{i}"]').bounding_box() for i in range(4)]
        assert all(boxes), boxes
        assert all(abs(b["x"] - boxes[0]["x"]) <= 1 for b in boxes), boxes
        assert all(a["y"] + a["height"] <= b["y"] + 1 for a, b in pairwise(boxes)), boxes
        # Readable: nothing wider than the phone.
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= PHONE["width"], width
        page.screenshot(path=str(tmp_path / "ui-phone.png"), full_page=True)
    finally:
        context.close()
    assert not watch.problems(), watch.problems()
