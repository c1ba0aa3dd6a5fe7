"""The repository as a newcomer meets it: a README that stays a short user's guide, reference pages that
name pages that exist, and results kept out of the tree (a run's data goes under results/, ignored)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_stays_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, "README.md is a user's guide: put reference material in a page under docs/"


def test_the_pages_the_docs_name_exist() -> None:
    named = set()
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "gpu").glob("*.md")]
    for page in pages:
        named |= set(re.findall(r"(?<![\w/.:-])((?:docs|gpu)/[\w./-]+\.md)\b", page.read_text()))
    assert sorted(p for p in named if not (ROOT / p).is_file()) == []


def _tracked(path: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", path], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_docs_hold_pages_and_a_few_plots_not_results() -> None:
    files = _tracked("docs")
    assert sum(f.stat().st_size for f in files if f.exists()) <= 2 * 1024 * 1024, "docs/ over 2 MB"
    kinds = {f.suffix for f in files}
    assert kinds <= {".md", ".png"}, f"results belong under results/ (git-ignored), not docs/: {kinds}"
    assert len([f for f in files if f.suffix == ".png"]) <= 8, "only the plots BENCHMARKS.md shows"


# What a reader outside this project's process cannot follow: its issue numbers, rounds and stops, its branch
# names, and documents that are not in the repository.
PROCESS = re.compile(
    r"\bissues? #?\d+"
    r"|\bround \d+\b|\bstop \d+\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth) stop\b"
    r"|\b(?:goodput|hotpath|edges|seam|core|docs|ops|doctor|writeback)\d+\b"
    r"|\.\./shared\b|/work/|vllm-shapes\.md|vllm-pd-protocol\.md|performance-anchors|style-anchors"
    r"|vllm-scale-out|landscape\.md",
    re.IGNORECASE,
)
SCANNED = ("src", "tests", "docs", "gpu", "plugins", "scripts", "deploy", "examples", "README.md", "BENCHMARKS.md")


def test_no_process_words_or_outside_references() -> None:
    found = []
    for path in (p for top in SCANNED for p in _tracked(top)):
        if path == Path(__file__).resolve() or path.suffix in {".png", ".gz", ".tgz"} or not path.exists():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if match := PROCESS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {match.group(0)!r}")
    assert found == [], "name the change, the run or vLLM's own file instead"
