"""Every link in the repository's documentation resolves inside the repository.

For README.md, BENCHMARKS.md, docker/README.md and every docs/**/*.md: a relative link or
image target names a file or folder that exists, an `#anchor` (in the same file or another
.md) names one of that file's headings by GitHub's slug rules, and no target climbs out of
the repository root (`../shared/...`). http(s) and mailto links are not fetched.

Repository paths written in code spans count too: a token of a code span that starts with
one of the top-level folders (`tests/`, `engine/`, `server/`, `kernels/`, `scripts/`,
`plait/`, `docs/`, `docker/`) and ends with a file extension or a `/` must exist (a `*`
must match something), so a moved or renamed file leaves no stale path behind.
docs/bench/history.md is a dated record of past runs and keeps the paths of its day.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.paths import REPO

ROOT = REPO
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "docker" / "README.md",
               *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), the target up to whitespace or ')'; an optional title.
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")
TOP_FOLDERS = ("tests", "engine", "server", "kernels", "scripts", "plait", "docs", "docker")
# A path token: a top-level folder, then path characters, ending in `.ext` or `/`.
CODE_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP_FOLDERS)})/[\w./*-]*(?:\.\w+|/))"
                       rf"(?![\w/*-])")
DATED_RECORDS = {"docs/bench/history.md"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lowercase, every character but
    letters, digits, spaces, '-' and '_' removed, spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose(path: Path) -> str:
    """The file's text without fenced code blocks and code spans, where brackets are code."""
    return CODE_SPAN.sub("", FENCE.sub("", path.read_text()))


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_targets(path: Path) -> list[str]:
    text = prose(path)
    return INLINE_LINK.findall(text) + REFERENCE_DEF.findall(text)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The link targets of one file that do not resolve, each with the reason."""
    problems = []
    for target in link_targets(path):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.is_relative_to(root):
            problems.append(f"{target}: leaves the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def stale_code_paths(path: Path, root: Path = ROOT) -> list[str]:
    """The repository paths in the file's code spans that name nothing in the checkout."""
    text = FENCE.sub("", path.read_text())
    problems = []
    for span in CODE_SPAN.findall(text):
        for token in CODE_PATH.findall(span):
            found = list(root.glob(token.rstrip("/"))) if "*" in token else [root / token]
            if not any(p.exists() and (p.is_dir() or not token.endswith("/")) for p in found):
                problems.append(f"{token}: no such path")
    return problems


def test_slug_follows_github_rules() -> None:
    assert slug("Playground (/ui)") == "playground-ui"
    assert slug("`plait bench`") == "plait-bench"
    assert slug("Side by side with vLLM and llama.cpp") == "side-by-side-with-vllm-and-llamacpp"
    assert (slug("KV-cache events (`--kv-events-endpoint`)")
            == "kv-cache-events---kv-events-endpoint")


def test_a_broken_link_is_caught(tmp_path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Second part\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#second-part) [gone](missing.md) [bad](a.md#third) "
                    "[out](../shared/x.md) [web](https://example.com) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page, root=tmp_path) == ["missing.md: no such file",
                                  "a.md#third: no heading with anchor #third in a.md",
                                  "../shared/x.md: leaves the repository"]


def test_a_stale_code_path_is_caught(tmp_path) -> None:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_a.py").write_text("")
    page = tmp_path / "c.md"
    page.write_text("`tests/unit/test_a.py` `tests/test_a.py` `tests/unit/` `tests/gone/` "
                    "`tests/unit/test_*.py` `tests/test_*.py` `pytest tests/unit/test_a.py -x` "
                    "`tests/unit` `mytests/x.py` `https://x.org/docs/a.md`\n"
                    "```\n`tests/fenced.py`\n```\n")
    assert stale_code_paths(page, root=tmp_path) == [
        "tests/test_a.py: no such path", "tests/gone/: no such path",
        "tests/test_*.py: no such path"]


def test_docs_exist() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "BENCHMARKS.md", "docs/ARCHITECTURE.md",
            "docs/bench/history.md"} <= names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve_inside_the_repository(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", [p for p in DOCS
                                  if p.relative_to(ROOT).as_posix() not in DATED_RECORDS],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_span_paths_exist(path: Path) -> None:
    assert stale_code_paths(path) == []
