"""The reliability suite end to end, smoke-sized: 20 conversations at once for 16 s, through a real
gateway, Redis and simulated engines, then the report and the resource plot.

Checks structure and the invariants the suite exists for (no failed turn, no turn that lost its state to
the store, the processes sampled before, during and after the load), never timings or memory sizes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from turnkv.bench.records import RunResult
from turnkv.bench.sampler import Series
from turnkv.bench.scenarios.reliability import STORE_REASONS

pytestmark = pytest.mark.integration

STREAMS = 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reliability")
    cmd = [sys.executable, "-m", "turnkv", "bench", "scenarios", "--suite", "reliability", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--conversations", str(STREAMS), "--duration", "16", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_every_turn_answered_with_its_state(out: Path) -> None:
    [c] = RunResult.read(out / "results.json").configs
    assert c.workload["concurrency"] == STREAMS
    assert len({r.conversation for r in c.requests}) >= STREAMS  # every slot ran a conversation
    assert any(r.turn > 1 for r in c.requests)
    for r in c.requests:
        assert r.error is None and r.status == 200
        assert {"outcome", "action", "reason"} <= set(r.decision), r.decision
        assert r.decision["reason"] not in STORE_REASONS
    later = [r for r in c.requests if r.turn > 1]
    assert all(r.decision["outcome"] != "stateless" for r in later), [r.decision for r in later]
    assert any("--redis-url" in cmd for cmd in c.meta["commands"])


def test_every_process_is_sampled_before_during_and_after_the_load(out: Path) -> None:
    [c] = RunResult.read(out / "results.json").configs
    res = c.meta["resources"]
    start, end = res["load_start_s"], res["load_end_s"]
    assert set(res["series"]) == {"prefill", "decode", "gateway", "redis", "client"}
    for name, d in res["series"].items():
        s = Series.from_dict(d)
        assert s.t[0] <= start and s.t[-1] > end, name
        assert any(start < t < end for t in s.t), name
        assert all(x > 0 for x in s.rss_mib) and all(n > 0 for n in s.fds), name
    gw = Series.from_dict(res["series"]["gateway"])
    # the clients' connections are the gateway's descriptors: the sampler reads the right process
    assert max(gw.fds) >= gw.fds[0] + STREAMS


def test_report_and_plot(out: Path) -> None:
    md = (out / "report.md").read_text()
    assert "## Reliability" in md
    assert "because of the store (store_unavailable / store_busy): **0**" in md
    assert "| gateway | " in md and "Growth: " in md
    assert (out / "resources.png").read_bytes()[:8] == PNG_MAGIC
