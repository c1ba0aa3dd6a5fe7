"""gpu/load.py's bookkeeping, which decides what the H200 load proof reports: which turns count as hung
(the client's deadline) or failed, what a cut wave left unanswered, the downsampled timeline, and the
/metrics parsing of the gateway's labelled counters."""

from __future__ import annotations

import sys
from pathlib import Path

from turnkv.bench.records import RequestRecord
from turnkv.bench.workload import Conversation, WorkloadSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))

import devlib
import load


def _rec(conv: int, turn: int, ttft: float | None = 100.0, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        conversation=conv,
        turn=turn,
        start_s=float(turn),
        ttft_ms=ttft,
        latency_ms=500.0,
        itl_ms=[10.0, 20.0],
        status=200 if error is None else 504,
        error=error,
    )


def test_deadline_misses_failures_and_unanswered_turns_are_counted_apart() -> None:
    spec = WorkloadSpec(conversations=3, turns=3, system_tokens=5, user_tokens=2)
    convs = [Conversation(i, spec) for i in range(3)]
    for c, sent in zip(convs, (3, 1, 2), strict=True):  # conversation 2's second turn was in flight at the cut
        for _ in range(sent):
            c.next_request()
            c.answered("x", "")
    records = [
        _rec(0, 1, 900.0),
        _rec(0, 2, 50.0),
        _rec(0, 3, 70.0),
        _rec(1, 1, None, "TimeoutError: "),  # the client gave up: hung; its conversation stops
        _rec(2, 1, 800.0),
    ]
    convs[2].messages[-1:] = []  # the in-flight turn has no answer
    s, rows = load.wave_summary(records, convs, spec, cut=True, offset_s=10.0)
    assert (s["answered"], s["ok"], s["hung"], s["failed"]) == (5, 4, 1, 0)
    assert s["sent"] == 6 and s["in_flight_at_cut"] == 1 and s["not_sent"] == 3 and s["cut"] is True
    assert s["ttft_ms"]["turn 1"]["n"] == 2 and s["ttft_ms"]["later turns"]["n"] == 2
    assert s["ttft_ms"]["later turns"]["max"] == 70.0
    assert [r[-1] for r in rows] == [0, 0, 0, 1, 0] and rows[0][0] == 11.0  # start from the mode's start
    failed = [
        _rec(0, 1, None, 'error event: {"message": "the decode engine missed its first-token deadline"}'),
        _rec(1, 1, None, "HTTP 504: b'...'"),
    ]
    s, _ = load.wave_summary(failed, convs[:2], spec, cut=False, offset_s=0.0)
    assert (s["hung"], s["failed"]) == (0, 2)  # the gateway answered: not a hang


def test_a_long_timeline_keeps_its_peaks_within_the_point_budget() -> None:
    samples = [{"t": i * 0.5, "d_kv": 0.1, "d_wait": 0.0} for i in range(1000)]
    samples[333]["d_kv"] = 0.99
    samples[334]["d_wait"] = 7.0
    del samples[500]["d_wait"]
    cols = load.timeline(samples, max_points=100)
    assert len(cols["t"]) == 100 and cols["t"][0] == 0.0
    assert max(cols["d_kv"]) == 0.99 and max(cols["d_wait"]) == 7.0
    assert load.timeline(samples[:10], max_points=100)["t"] == [s["t"] for s in samples[:10]]


def test_labelled_counters_and_their_deltas() -> None:
    text = "\n".join(
        [
            "# HELP turnkv_handle_releases_total Handles released",
            'turnkv_handle_releases_total{why="budget"} 3.0',
            'turnkv_handle_releases_total{why="pressure"} 1.0',
            'turnkv_handle_releases_created{why="budget"} 1.7e9',
            'vllm:kv_cache_usage_perc{engine="0",model_name="model"} 0.25',
        ]
    )
    samples = devlib.metric_samples(text, ("turnkv_handle_releases",))
    assert ("turnkv_handle_releases_total", {"why": "budget"}, 3.0) in samples
    assert all(name.startswith("turnkv_handle_releases") for name, _, _ in samples)
    assert devlib.metric_samples(text, ("vllm:",)) == [
        ("vllm:kv_cache_usage_perc", {"engine": "0", "model_name": "model"}, 0.25)
    ]
    before = {"turnkv_handle_releases_total": {"why=budget": 1.0}}
    after = {"turnkv_handle_releases_total": {"why=budget": 3.0, "why=pressure": 1.0, "why=unused": 0.0}}
    assert load.counter_delta(before, after) == {
        "turnkv_handle_releases_total": {"why=budget": 2.0, "why=pressure": 1.0}
    }


def test_the_estimate_grows_with_the_load_and_with_a_cold_prefill_cache() -> None:
    def est(n: int, turns: int, mode: str = "plain", p_cache: bool = True) -> float:
        return float(load.estimate_wave_s(n, turns, 8192, 200, 128, 0.5, mode=mode, p_cache=p_cache))

    assert est(32, 4) < est(64, 4) and est(32, 3) < est(32, 4)
    assert est(32, 4, p_cache=False) > est(32, 4)
    assert est(32, 4, "colocated", p_cache=False) == est(32, 4, "colocated")  # colocated does not use P
