"""The goodput suite end to end, shrunk: every configuration of 1P1D at one rate on real simulator and
gateway processes, then the report. Structure only (every turn answered, the decisions each
configuration stands for, the tables and the plot), never timings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from turnkv.bench.records import RunResult
from turnkv.bench.scenarios.goodput import DEFAULT_CONFIGS, WORKLOAD

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONVERSATIONS = 3


@pytest.fixture(scope="module")
def sweep_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("goodput")
    cmd = [
        sys.executable,
        "-m",
        "turnkv",
        "bench",
        "scenarios",
        "--suite",
        "goodput",
        "--topology",
        "1p1d",
        "--rates",
        "2",
        "--conversations",
        str(CONVERSATIONS),
        "--max-conversations",
        str(CONVERSATIONS),
        "--time-scale",
        "0.05",
        "--out",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_every_configuration_answered_every_turn(sweep_out: Path) -> None:
    run = RunResult.read(sweep_out / "results.json")
    assert [c.name for c in run.configs] == [f"1p1d-{c}-r2" for c in DEFAULT_CONFIGS]
    for c in run.configs:
        assert len(c.requests) == CONVERSATIONS * WORKLOAD.turns, c.name
        assert all(r.ok and r.completion_tokens == WORKLOAD.answer_tokens for r in c.requests), c.name


def test_each_configuration_is_what_it_stands_for(sweep_out: Path) -> None:
    configs = {c.meta["tags"]["config"]: c for c in RunResult.read(sweep_out / "results.json").configs}
    later = {k: [r for r in c.requests if r.turn > 1] for k, c in configs.items()}
    assert all(not r.decision for r in configs["colocated"].requests)
    # two colocated engines for 1P1D's two GPUs
    assert configs["colocated"].meta["commands"][0].endswith("(x2)")
    assert {r.decision["outcome"] for r in later["plain"]} == {"stateless"}
    multiturn = [(r.decision["action"], r.decision.get("reason")) for r in later["vllm-multiturn"]]
    assert {action for action, _ in multiturn} == {"pull"}, multiturn
    assert {r.decision["action"] for r in later["adaptive-pull"]} <= {"pull", "recompute"}
    # engines at 1/20 of real time and three conversations: D is never busy, so decode-local stays in the
    # ITL budget; where another turn's prefill shares D's step, the headroom (10% of D's step) may say no.
    # A turn after one that headroom sent through P finds its history in P's prefix cache: P's path may then
    # be the cheaper (recompute only the new tokens, or pull the rest), as its estimates say
    adaptive = [(r.decision["action"], r.decision.get("reason")) for r in later["adaptive"]]
    through_p = {("recompute", "itl_headroom"), ("recompute", "cheaper_to_recompute"), ("pull", "full_match")}
    assert any(action == "decode_local" for action, _ in adaptive), adaptive
    assert all(action == "decode_local" or (action, why) in through_p for action, why in adaptive), adaptive


def test_report_tables_targets_and_plot(sweep_out: Path) -> None:
    md = (sweep_out / "report.md").read_text()
    for heading in ("## 1p1d", "### Goodput", "### TTFT ms", "### ITL ms", "### TPOT ms", "## Targets"):
        assert heading in md
    assert "| goodput >= best of colocated, plain, vllm-multiturn | 1p1d r2" in md
    assert "| ITL p99 <= 1.10x plain P/D | 1p1d r2 |" in md
    assert (sweep_out / "goodput_vs_rate.png").read_bytes()[:8] == PNG_MAGIC
