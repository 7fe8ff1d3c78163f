"""Helpers for the browser tests of the /ui playground (tests/server/test_ui_browser.py).

Headless Chromium driven by Playwright's Python package through `executable_path`: a
system Chromium (Debian's `chromium` package) rather than `playwright install`, whose CDN
is not reachable everywhere. Set PLAIT_UI_CHROMIUM to use another binary.

    find_chromium()          -> path of a Chromium binary, or None
    skip_reason()            -> why the browser tests cannot run here, or None
    launch(playwright)       -> a headless Browser with the flags that work offline
    PageWatch(page, origin)  records console errors, page errors, other-origin requests and
                             the bodies of chat completion requests
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# --headless: no display; --no-sandbox: root in containers; the background-networking
# flags keep Chromium from calling home (where that is refused, Chromium's own connections
# fail and show up as noise).
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync"]

_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome",
               "/usr/bin/google-chrome-stable")


def find_chromium() -> str | None:
    env = os.environ.get("PLAIT_UI_CHROMIUM")
    if env:
        return env if Path(env).is_file() else None
    for path in _CANDIDATES:
        if Path(path).is_file() and os.access(path, os.X_OK):
            return path
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def skip_reason() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return ("the Python package `playwright` is not installed "
                "(`make test-ui` installs it, or: pip install playwright)")
    if find_chromium() is None:
        return ("no Chromium binary (apt-get install chromium, or set PLAIT_UI_CHROMIUM); "
                "`make test-ui` installs it")
    return None


def launch(playwright: Any):
    return playwright.chromium.launch(executable_path=find_chromium(), args=LAUNCH_ARGS,
                                      headless=True)


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@dataclass
class PageWatch:
    """Everything a page did that a test checks afterwards."""

    page: Any
    server_origin: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    foreign_requests: list[str] = field(default_factory=list)
    chat_bodies: list[dict[str, Any]] = field(default_factory=list)
    chat_responses: list[Any] = field(default_factory=list)
    # Console errors a test expects (the browser's own "Failed to load resource: ... 401").
    allowed: list[re.Pattern[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda error: self.page_errors.append(str(error)))
        self.page.on("request", self._on_request)
        self.page.on("response", self._on_response)

    def _on_console(self, message: Any) -> None:
        if message.type == "error":
            self.console_errors.append(f"{message.text} @ {message.location}")

    def _on_request(self, request: Any) -> None:
        url = request.url
        if urlsplit(url).scheme in ("http", "https", "ws", "wss") and \
                origin(url) != self.server_origin:
            self.foreign_requests.append(url)
        if request.method == "POST" and urlsplit(url).path == "/v1/chat/completions":
            self.chat_bodies.append(json.loads(request.post_data or "null"))

    def _on_response(self, response: Any) -> None:
        if urlsplit(response.url).path == "/v1/chat/completions":
            self.chat_responses.append(response)

    def allow(self, pattern: str) -> None:
        self.allowed.append(re.compile(pattern))

    def problems(self) -> list[str]:
        errors = [e for e in self.console_errors
                  if not any(p.search(e) for p in self.allowed)]
        return ([f"console error: {e}" for e in errors]
                + [f"page error: {e}" for e in self.page_errors]
                + [f"request to another origin: {u}" for u in self.foreign_requests])


# In the page: a MutationObserver over every [data-choice] element that records, at each
# DOM change, how many choices have text and how many have a finish reason, so that a
# test sees every state the page went through, not just the ones a poll happened to hit.
OBSERVE_JS = """() => {
  const log = window.__plaitChoiceLog = [];
  const snap = () => {
    const els = [...document.querySelectorAll('[data-choice]')];
    log.push({t: performance.now(),
              withText: els.filter(e => e.textContent.length > 0).length,
              finished: els.filter(e => e.hasAttribute('data-finish-reason')).length,
              total: els.length});
  };
  if (window.__plaitObserver) window.__plaitObserver.disconnect();
  window.__plaitObserver = new MutationObserver(snap);
  window.__plaitObserver.observe(document.body, {subtree: true, childList: true,
    characterData: true, attributes: true, attributeFilter: ['data-finish-reason']});
  snap();
}"""

CHOICES_JS = """() => [...document.querySelectorAll('[data-choice]')].map(e => ({
  index: Number(e.dataset.choice), text: e.textContent,
  finish: e.getAttribute('data-finish-reason')}))"""


def choices(page: Any) -> list[dict[str, Any]]:
    """[{index, text, finish}] of the page's [data-choice] elements, by index."""
    return sorted(page.evaluate(CHOICES_JS), key=lambda c: c["index"])


def sse_chunks(body: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body (ignores comments and [DONE])."""
    out = []
    for block in body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: "):]))
    return out
