"""gpu/ttft.py's run order, which decides what a mode's TTFT is compared with: in ``rounds`` every mode
once per round in the same order, in ``abba`` every other round reversed, so that no mode always runs
first (the H200's run 4 had vllm-multiturn first in every round)."""

from __future__ import annotations

import json
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


def _run(mode: str, rep: int, seq: int, ttfts: list[float]) -> dict[str, object]:
    turns = [{"ttft_ms": 500.0, "status": 200}] + [{"ttft_ms": t, "status": 200} for t in ttfts]
    events = [{"turn": i + 2, "ttft_ms": t - 1, "prefill_ms": t / 2, "render_ms": 0.5} for i, t in enumerate(ttfts)]
    return {"history": 2048, "mode": mode, "rep": rep, "seq": seq, "turns": turns, "gateway_turns": events}


def test_the_report_compares_each_mode_with_vllm_multiturn_per_round(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ttft_report

    runs = [
        _run("vllm-multiturn", 0, 0, [100.0, 100.0]),
        _run("always-pull", 0, 1, [110.0, 110.0]),
        _run("always-pull", 1, 2, [90.0, 90.0]),
        _run("vllm-multiturn", 1, 3, [100.0, 100.0]),
    ]
    path = tmp_path / "ttft_a.json"
    path.write_text(json.dumps({"runs": runs}))
    ttft_report.main([path])
    out = capsys.readouterr().out
    assert "| 2k | always-pull | 4 | 100 | 1.00x | 1.00x (0.90-1.10, 2 rounds) |" in out
    assert "| 2k | always-pull | before vllm-multiturn | 1 | 0.900x" in out  # abba: its place in the round
