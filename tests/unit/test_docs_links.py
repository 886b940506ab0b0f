"""The README and docs/: every relative link names a file that exists and, with `#anchor`, a heading in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MAX_LINES = 300


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    in_code = False
    out: set[str] = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(_anchor(line.lstrip("#")))
    return out


def broken_links(doc: Path, *, root: Path = ROOT) -> list[str]:
    problems = []
    for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # an absolute URL: not checked offline
            file_part, _, anchor = target.partition("#")
            dest = doc if not file_part else (doc.parent / file_part).resolve()
            if not dest.exists():
                problems.append(f"{doc.relative_to(root)}:{lineno}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{doc.relative_to(root)}:{lineno}: {target}: no heading #{anchor}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Real heading\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](other.md#real-heading) [b](missing.md) [c](other.md#nope) [d](https://x.org/y)\n",
                   encoding="utf-8")
    problems = broken_links(doc, root=tmp_path)
    assert problems == ["doc.md:1: missing.md: no such file", "doc.md:1: other.md#nope: no heading #nope"]


def test_readme_stays_a_short_manual() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; details belong in docs/"
