"""The front door and its pages: README.md stays a front door (at most 20 KB), and every relative link
in README.md and docs/ reaches a file of the repository and, with a #fragment, one of its headings
(GitHub's anchors: lowercase, punctuation dropped, spaces to hyphens, -1, -2 for repeats)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page` (code blocks skipped)."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        yield slug if n == 0 else f"{slug}-{n}"


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(FENCE.sub("", page.read_text()))]


def test_the_readme_is_a_front_door():
    assert (REPO / "README.md").stat().st_size <= 20 * 1024


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_its_file_and_heading(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(
                f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}"
            )
        elif fragment and dest.suffix == ".md" and fragment not in set(anchors(dest)):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_anchor_rule_is_githubs():
    """The check's own rule, on headings whose anchors GitHub is known to give."""
    page = REPO / "docs" / "benchmarks.md"
    got = set(anchors(page))
    assert "in-process-recovery-onto-a-spare" in got and "--help-and-compose" in got
