"""docs/decisions.md lists exactly the reason codes, capture results and fall-backs the gateway emits."""

from __future__ import annotations

import re
from pathlib import Path

from turnkv.gateway.turn.results import Capture, Fallback
from turnkv.reuse.assess import Reason

PAGE = Path(__file__).resolve().parents[2] / "docs" / "decisions.md"


def _codes(section: str, column: int = 0) -> list[str]:
    """The codes named in one column of the table under ``## section``."""
    text = PAGE.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| `")]
    return [code for row in rows for code in re.findall(r"`([a-z_]+)`", row[column])]


def test_every_reason_code_and_no_other() -> None:
    listed = _codes("Reason codes")
    assert len(listed) == len(set(listed)), "a reason listed twice"
    assert set(listed) == {r.value for r in Reason}


def test_every_capture_result_and_no_other() -> None:
    listed = _codes("Capture results")
    assert len(listed) == len(set(listed)), "a capture result listed twice"
    assert set(listed) == {c.value for c in Capture}


def test_every_fall_back() -> None:
    legs, whys = _codes("Retries", 0), _codes("Retries", 1)
    assert set(zip(legs, whys, strict=True)) == {f.value for f in Fallback}
