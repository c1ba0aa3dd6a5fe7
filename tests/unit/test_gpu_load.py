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


def test_one_think_seed_pauses_conversations_alike_whatever_their_words() -> None:
    def run(seed: int, think_seed: int | None) -> tuple[list[float], str]:
        conv = Conversation(0, WorkloadSpec(seed=seed, think_seed=think_seed, system_tokens=20, user_tokens=5))
        pauses = []
        for _ in range(4):
            conv.next_request()
            pauses.append(conv.think_time())
        return pauses, str(conv.messages)

    a, b = run(1, think_seed=7), run(2, think_seed=7)
    assert a[0] == b[0] and a[1] != b[1]  # the same pauses, other words (no prefix P could have cached)
    assert run(1, None)[0] != run(2, None)[0]  # without a think seed, the words' seed draws the pauses too
    assert run(1, None) == run(1, None)


def test_rounds_of_modes_are_compared_with_plain_of_the_same_round() -> None:
    import goodput_report as gr

    def wave(good: float, itl: float) -> dict[str, object]:
        return {
            "wave": 1,
            "conversations": 8,
            "wall_s": 10.0,
            "goodput": {"goodput_per_s": good},
            "itl_ms": {"p50": 20.0, "p99": itl},
            "ttft_ms": {"turn 1": {"p50": 1, "p99": 2}, "later turns": {"p50": 100.0, "p99": 200.0}},
        }

    def part(label: str, runs: list[tuple[str, int, float, float]]) -> dict[str, object]:
        modes = [{"mode": m, "round": r, "requests_key": m, "waves": [wave(g, i)]} for m, r, g, i in runs]
        return {"label": label, "modes": modes, "requests": {}}

    g4 = part(
        "G4", [("adaptive", 1, 2.0, 60.0), ("plain", 1, 1.0, 50.0), ("adaptive", 2, 3.0, 40.0), ("plain", 2, 2.0, 50.0)]
    )
    g5 = part("G5", [("adaptive", 1, 1.5, 55.0), ("plain", 1, 3.0, 50.0), ("colocated", 1, 2.5, 90.0)])
    keys = [k for *_, k in gr.mode_keys([g4, g5])]
    assert keys == [
        "adaptive (G4) #1",
        "plain (G4) #1",
        "adaptive (G4) #2",
        "plain (G4) #2",
        "adaptive (G5)",
        "plain (G5)",
        "colocated",
    ]
    pts = gr.points([g4, g5])
    head, body = gr.spread(pts)
    assert body[0][:5] == ["8", "adaptive", "3", "2.00 (1.50-3.00)", "55.0 (40.0-60.0)"]
    _, (row,) = gr.spread_targets(pts, ["adaptive"])
    # paired with plain of the same part and round: 2/1, 3/2, 1.5/3; ITL 60/50, 40/50, 55/50
    assert row[4] == "1.50 (0.50-2.00) of 3" and row[5] == "1.10 (0.80-1.20) of 3"
    assert row[2] == "colocated (2.50/s)" and row[3] == "0.80x"  # medians: adaptive 2.0, plain 2.0, colocated 2.5
