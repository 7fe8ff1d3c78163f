"""Every link in the repository's documentation resolves inside the repository.

For README.md, BENCHMARKS.md, docker/README.md and every docs/**/*.md: a relative link or
image target names a file or folder that exists, an `#anchor` (in the same file or another
.md) names one of that file's headings by GitHub's slug rules, and no target climbs out of
the repository root (`../shared/...`). http(s) and mailto links are not fetched.
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


def test_docs_exist() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "BENCHMARKS.md", "docs/ARCHITECTURE.md",
            "docs/bench/history.md"} <= names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve_inside_the_repository(path: Path) -> None:
    assert broken_links(path) == []
