"""gpu/ttft.py's run order, which decides what a mode's TTFT is compared with: in ``rounds`` every mode
once per round in the same order, in ``abba`` every other round reversed, so that no mode always runs
first (the H200's run 4 had vllm-multiturn first in every round)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))

import ttft

MODES = ["vllm-multiturn", "always-pull", "always-pull-beside"]


@pytest.mark.parametrize("order", ["modes", "rounds", "abba"])
def test_every_history_mode_and_rep_runs_once(order: str) -> None:
    plan = ttft.run_order([2048, 16384], MODES, 4, order)
    assert Counter(plan) == Counter((h, m, r) for h in (2048, 16384) for m in MODES for r in range(4))
    assert [h for h, _, _ in plan] == sorted(h for h, _, _ in plan)  # history by history


def test_abba_reverses_every_other_round() -> None:
    plan = ttft.run_order([2048], MODES[:2], 4, "abba")
    rounds = [[m for _, m, r in plan if r == rep] for rep in range(4)]
    assert [rnd[0] for rnd in rounds] == ["vllm-multiturn", "always-pull", "vllm-multiturn", "always-pull"]
    assert [r for _, _, r in plan] == [0, 0, 1, 1, 2, 2, 3, 3]  # a round's modes back to back


def test_rounds_keep_one_order() -> None:
    plan = ttft.run_order([2048], MODES, 3, "rounds")
    assert {tuple(m for _, m, r in plan if r == rep) for rep in range(3)} == {tuple(MODES)}
