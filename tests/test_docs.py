"""The README and docs/ (with its subfolders, e.g. docs/measurements/): every relative link names
a file that exists and, with an anchor, a heading of that file (anchors as GitHub writes them),
so moving or renaming a section is caught; and no page is over 1,500 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_LINES = 1500  # a page longer than this is split by topic (docs/measurements/)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped but ``-`` and ``_``,
    spaces made ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (outside code blocks); a repeated one gets ``-1``..."""
    seen: dict[str, int] = {}
    found = set()
    for line in _FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            anchor = heading_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def test_heading_anchor_follows_github():
    assert heading_anchor("Spans for `prob:kvzip` (S10.3)") == "spans-for-probkvzip-s103"
    assert heading_anchor("Wider: 4,096 tokens, r = 0.25") == "wider-4096-tokens-r--025"
    assert heading_anchor("The core and the sampler's seed") == "the-core-and-the-samplers-seed"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    bad = []
    for target in _LINK.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # a URL, not a file of this repository
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and anchor not in anchors(linked):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{page.name}: {bad}"


def test_pages_found_in_subfolders():
    assert ROOT / "docs" / "evaluation.md" in PAGES
    assert any(p.parent.name == "measurements" for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_not_over_max_lines(page):
    lines = page.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{page.name}: {lines} lines; split it by topic"
