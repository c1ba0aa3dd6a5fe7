"""The repository as a newcomer meets it: a README that stays a short user's guide."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_stays_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, "README.md is a user's guide: put reference material in a page under docs/"


def test_the_pages_the_docs_name_exist() -> None:
    named = set()
    for page in [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "gpu").glob("*.md"),
    ]:
        named |= set(re.findall(r"(?<![\w/.-])((?:docs|gpu)/[\w./-]+\.md)\b", page.read_text()))
    assert sorted(p for p in named if not (ROOT / p).is_file()) == []
