"""The playground at /ui over HTTP (no browser; tests/server/test_ui_browser.py drives one): its
files, the CSP it runs under, that it loads nothing from elsewhere and runs no inline code,
the --ui switch, the API key, and the selectors the browser tests and README rely on."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import httpx
import pytest
from helpers.paths import REPO
from helpers.scripted import ScriptedCore, scripted_engine
from helpers.server import API_KEY, InProcessServer, parse_sse

from plait.cli import build_parser, server_settings
from plait.server.app import create_app
from plait.server.settings import ServerSettings
from plait.server.ui import CONTENT_SECURITY_POLICY, UI_DIR

README = REPO / "README.md"
# Selector -> (tag, attribute, value): each must be in index.html or created by ui.js.
SELECTORS = {
    "textarea[name=prompt]": ("textarea", "name", "prompt"),
    "input[name=n]": ("input", "name", "n"),
    "button[type=submit]": ("button", "type", "submit"),
    "button[name=stop]": ("button", "name", "stop"),
    "input[name=api_key]": ("input", "name", "api_key"),
    "[data-role=shared]": (None, "data-role", "shared"),
    "[data-role=ops]": (None, "data-role", "ops"),
    "[data-role=error]": (None, "data-role", "error"),
    "pre[data-role=copy-output]": ("pre", "data-role", "copy-output"),
    "textarea[name=system]": ("textarea", "name", "system"),
    "input[name=temperature]": ("input", "name", "temperature"),
    "input[name=top_p]": ("input", "name", "top_p"),
    "input[name=max_tokens]": ("input", "name", "max_tokens"),
    "input[name=seed]": ("input", "name", "seed"),
    "textarea[name=stop]": ("textarea", "name", "stop"),
    "textarea[name=json_schema]": ("textarea", "name", "json_schema"),
    "input[name=logprobs]": ("input", "name", "logprobs"),
}
# Made per choice by ui.js: the text element, its finish reason, the continue button.
JS_SELECTORS = ('"data-choice"', '"data-finish-reason"', '"data-continue"')


class Page(HTMLParser):
    """Every start tag with its attributes, and the text inside <script>/<style>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline: list[str] = []
        self._in_code = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_code = tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self._in_code = False

    def handle_data(self, data: str) -> None:
        if self._in_code and data.strip():
            self.inline.append(data)


def parse_page(html: str) -> Page:
    page = Page()
    page.feed(html)
    return page


@pytest.fixture
def core(tokenizer) -> ScriptedCore:
    return ScriptedCore(tokenizer)


def serve(core: ScriptedCore, **settings) -> InProcessServer:
    return InProcessServer(create_app(ServerSettings(**settings), engine=scripted_engine(core)))


def test_ui_serves_the_page_and_its_assets_under_a_strict_csp(core) -> None:
    with serve(core) as server, httpx.Client(base_url=server.url) as http:
        for path in ("/ui", "/ui/"):
            page = http.get(path)
            assert page.status_code == 200, page.text
            assert page.headers["content-type"] == "text/html; charset=utf-8"
            assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert page.text == (UI_DIR / "index.html").read_text()
        for name, media in (("ui.js", "text/javascript"), ("ui.css", "text/css")):
            asset = http.get(f"/ui/{name}")
            assert asset.status_code == 200
            assert asset.headers["content-type"] == f"{media}; charset=utf-8"
            assert asset.headers["x-content-type-options"] == "nosniff"
            assert asset.content == (UI_DIR / name).read_bytes()
        assert http.get("/ui/index.htm").status_code == 404  # only the three files
        assert "/ui" not in http.get("/openapi.json").json()["paths"]
    assert "script-src 'self';" in CONTENT_SECURITY_POLICY
    assert "'unsafe-inline'" not in CONTENT_SECURITY_POLICY


def test_page_loads_only_same_origin_files_and_runs_no_inline_code() -> None:
    html = (UI_DIR / "index.html").read_text()
    page = parse_page(html)
    assert page.inline == []
    urls = []
    for tag, attrs in page.tags:
        assert "style" not in attrs, tag
        assert not [name for name in attrs if name.startswith("on")], (tag, attrs)
        urls += [attrs[name] or "" for name in ("src", "href", "action") if name in attrs]
    assert sorted(urls) == ["/ui/ui.css", "/ui/ui.js", "data:,"]  # data:, the empty favicon
    assert not re.search(r"https?:|//[\w.-]", html)
    js = (UI_DIR / "ui.js").read_text()
    assert not re.search(r"\beval\(|new Function|innerHTML|setAttribute\(\"style|https?://", js)
    fetched = sorted(set(re.findall(r"fetch\(\"([^\"]+)\"", js)))
    assert fetched == ["/metrics", "/v1/chat/completions", "/v1/models"]  # the public API
    assert "sessionStorage" in js and "localStorage" not in js


def test_every_documented_selector_exists() -> None:
    page = parse_page((UI_DIR / "index.html").read_text())
    for selector, (tag, attribute, value) in SELECTORS.items():
        found = [t for t, attrs in page.tags
                 if attrs.get(attribute) == value and tag in (None, t)]
        assert found, selector
    assert len([1 for t, a in page.tags if a.get("type") == "submit"]) == 1
    assert any(t == "form" for t, _ in page.tags)
    js = (UI_DIR / "ui.js").read_text()
    for attribute in JS_SELECTORS:
        assert attribute in js, attribute
    section = README.read_text().split("## Playground (/ui)", 1)[1].split("\n## ", 1)[0]
    for selector in (*SELECTORS, "data-choice", "data-finish-reason", "data-continue"):
        assert selector in section, selector


@pytest.mark.parametrize(("host", "argv", "env", "on"), [
    ("127.0.0.1", [], {}, True),
    ("localhost", [], {}, True),
    ("::1", [], {}, True),
    ("0.0.0.0", [], {}, False),
    ("0.0.0.0", ["--ui"], {}, True),
    ("127.0.0.1", ["--no-ui"], {}, False),
    ("0.0.0.0", [], {"PLAIT_UI": "true"}, True),
    ("127.0.0.1", [], {"PLAIT_UI": "false"}, False),
    ("127.0.0.1", [], {"PLAIT_UI": "auto"}, True),
    ("0.0.0.0", ["--ui"], {"PLAIT_UI": "false"}, True),  # the flag wins
])
def test_ui_is_on_for_loopback_hosts_unless_the_option_says(host, argv, env, on) -> None:
    args = build_parser(env).parse_args(["serve", "--host", host, *argv])
    settings = server_settings(args)
    assert settings.ui == (None if not argv and env.get("PLAIT_UI") in (None, "auto")
                           else on)
    assert settings.ui_enabled is on


def test_ui_off_is_an_unknown_path(core) -> None:
    with serve(core, ui=False) as server, httpx.Client(base_url=server.url) as http:
        for path in ("/ui", "/ui/ui.js"):
            response = http.get(path)
            assert response.status_code == 404
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert "content-security-policy" not in response.headers


def test_page_is_open_with_an_api_key_and_the_api_is_not(core) -> None:
    with serve(core, api_keys=(API_KEY,)) as server, \
            httpx.Client(base_url=server.url) as http:
        assert http.get("/ui").status_code == 200
        assert http.get("/ui/ui.js").status_code == 200
        assert http.get("/metrics").status_code == 200  # the ops strip needs no key
        refused = http.get("/v1/models")
        assert refused.status_code == 401 and refused.json()["error"]["message"]
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert http.get("/v1/models", headers=auth).json()["data"][0]["id"] == "scripted-model"


def test_the_request_the_page_sends_streams_what_it_reads(core) -> None:
    """ui.js's request shape: n choices, logprobs, include_usage + continuous_usage_stats
    (each chunk's usage is its choice's token count so far), the usage chunk last."""
    body = {"model": "scripted-model", "n": 3, "max_tokens": 4, "seed": 7, "logprobs": True,
            "stop": ["zzz"], "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "messages": [{"role": "user", "content": "hi"}]}
    with serve(core) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/v1/chat/completions", json=body)
    stream = parse_sse(response.content)
    assert stream.events[-1] == "[DONE]"
    *chunks, last = stream.chunks
    tokens, finish = [0, 0, 0], [None, None, None]
    for chunk in chunks:
        (choice,) = chunk["choices"]
        tokens[choice["index"]] = chunk["usage"]["completion_tokens"]
        if choice["delta"].get("content"):
            assert choice["logprobs"]["content"][0]["logprob"] == -0.5
        finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
    assert tokens == [4, 4, 4] and finish == ["length"] * 3
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
