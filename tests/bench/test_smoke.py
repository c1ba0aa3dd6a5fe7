"""The smoke suite end to end: real engines and gateway processes on loopback, then the report files.

Checks structure only (per-turn rows, decision headers, no errors), never timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from turnkv.bench.records import RunResult
from turnkv.bench.scenarios.smoke import WORKLOAD

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smoke")
    proc = subprocess.run(
        [sys.executable, "-m", "turnkv", "bench", "scenarios", "--suite", "smoke", "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_results_json_holds_every_turn_of_every_configuration(smoke_out: Path) -> None:
    run = RunResult.read(smoke_out / "results.json")
    assert run.suite == "smoke"
    assert [c.name for c in run.configs] == ["smoke-colocated", "smoke-turnkv", "smoke-plain"]
    for c in run.configs:
        assert len(c.requests) == WORKLOAD.conversations * WORKLOAD.turns
        assert sorted({r.turn for r in c.requests}) == list(range(1, WORKLOAD.turns + 1))
        for r in c.requests:
            assert r.error is None and r.status == 200
            assert r.ttft_ms is not None and r.latency_ms is not None and r.ttft_ms <= r.latency_ms
            assert r.completion_tokens == WORKLOAD.answer_tokens
            assert r.prompt_tokens is not None and r.prompt_tokens > WORKLOAD.system_tokens


def test_turnkv_decisions_are_recorded(smoke_out: Path) -> None:
    configs = {c.name: c for c in RunResult.read(smoke_out / "results.json").configs}
    assert all(not r.decision for r in configs["smoke-colocated"].requests)
    for name in ("smoke-turnkv", "smoke-plain"):
        for r in configs[name].requests:
            assert {"outcome", "action", "reason"} <= set(r.decision), r.decision
    assert {r.decision["outcome"] for r in configs["smoke-plain"].requests} == {"stateless"}
    later = [r for r in configs["smoke-turnkv"].requests if r.turn > 1]
    # every later turn reused D's KV: checked token by token, or decode-local without a render
    assert all(int(r.decision.get("matched-tokens", 0)) > 0 or r.decision.get("direct") == "true" for r in later)
    assert "gateway_cpu_s" in configs["smoke-turnkv"].meta


def test_history_is_resent_as_received(smoke_out: Path) -> None:
    configs = {c.name: c for c in RunResult.read(smoke_out / "results.json").configs}
    for c in configs.values():
        by_conv: dict[int, list[int]] = {}
        for r in sorted(c.requests, key=lambda r: r.turn):
            by_conv.setdefault(r.conversation, []).append(r.prompt_tokens or 0)
        for lengths in by_conv.values():
            # each turn's prompt holds the previous prompt, its full answer and the new user message
            steps = [b - a for a, b in zip(lengths, lengths[1:], strict=False)]
            assert all(s > WORKLOAD.answer_tokens + WORKLOAD.user_tokens for s in steps), lengths


def test_markdown_and_png(smoke_out: Path) -> None:
    md = (smoke_out / "report.md").read_text()
    assert "| config | turn | n | errors | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |" in md
    for name in ("smoke-colocated", "smoke-turnkv", "smoke-plain"):
        rows = [line for line in md.splitlines() if line.startswith(f"| {name} | ")]
        assert len(rows) >= WORKLOAD.turns, name
    assert (smoke_out / "ttft_by_turn.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((smoke_out / "results.json").read_text())["format"] == 1


def test_the_suite_runs_its_gateways_as_workers(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "turnkv",
            "bench",
            "scenarios",
            "--suite",
            "smoke",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--only",
            "smoke-turnkv",
            "--gateway-workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    configs = {c.name: c for c in RunResult.read(tmp_path / "results.json").configs}
    assert set(configs) == {"smoke-turnkv"}  # --only picks loads, not the deployment's other load (smoke-plain)
    turnkv = configs["smoke-turnkv"]
    assert any("--workers 2" in c and "--redis-url" in c for c in turnkv.meta["commands"])
    assert all(r.ok for r in turnkv.requests)
    later = [r for r in turnkv.requests if r.turn > 1]
    assert all(int(r.decision.get("matched-tokens", 0)) > 0 or r.decision.get("direct") == "true" for r in later)
    assert turnkv.meta["gateway_cpu_s"] > 0  # the workers' CPU, not only the supervisor's
