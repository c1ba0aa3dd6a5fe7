"""Goodput under SLOs, the sweep's stopping rule and the goodput suite's targets, as tables."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from turnkv.bench.goodput import Slo, collapsed, geometric_rates, meets, next_rate, point_stats, tpot_ms
from turnkv.bench.records import ConfigResult, RequestRecord
from turnkv.bench.scenarios import goodput as suite
from turnkv.bench.scenarios.base import Bench
from turnkv.reuse.adaptive import AdaptivePolicy
from turnkv.reuse.policies import build_policy

SLO = Slo()


def rec(
    turn: int = 2,
    ttft: float | None = 100.0,
    latency: float | None = 100.0 + 127 * 20.0,
    tokens: int = 128,
    error: str | None = None,
    conversation: int = 0,
    start: float = 0.0,
    itl: list[float] | None = None,
    action: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        conversation=conversation,
        turn=turn,
        start_s=start,
        ttft_ms=ttft,
        latency_ms=latency,
        itl_ms=itl if itl is not None else [20.0] * (tokens - 1),
        completion_tokens=tokens,
        error=error,
        decision={"action": action} if action else {},
    )


@pytest.mark.parametrize(
    ("r", "tpot"),
    [
        (rec(), 20.0),  # (2640 - 100) / 127
        (rec(tokens=1, latency=100.0), 0.0),
        (rec(error="HTTP 500"), None),
        (rec(ttft=None), None),
    ],
)
def test_tpot_is_vllms(r: RequestRecord, tpot: float | None) -> None:
    assert tpot_ms(r) == (pytest.approx(tpot) if tpot is not None else None)


@pytest.mark.parametrize(
    ("r", "scale", "ok"),
    [
        (rec(), 1.0, True),
        (rec(ttft=2001.0, latency=2001.0 + 127 * 20), 1.0, False),  # TTFT over 2 s
        (rec(latency=100.0 + 127 * 31.0), 1.0, False),  # TPOT 31 ms
        (rec(error="boom"), 1.0, False),
        # at --time-scale 2 every duration is doubled: 60 ms of real TPOT is 30 simulated
        (rec(ttft=3000.0, latency=3000.0 + 127 * 60.0), 2.0, True),
    ],
)
def test_a_turn_meets_both_slos_or_not(r: RequestRecord, scale: float, ok: bool) -> None:
    assert meets(r, SLO, scale) is ok


def test_point_stats_counts_goodput_per_second_of_arrivals() -> None:
    recs = [
        rec(turn=1, ttft=300.0, latency=300.0 + 127 * 20, conversation=0, start=0.0),
        rec(turn=2, conversation=0, start=4.0, action="decode_local"),
        rec(turn=1, ttft=2500.0, latency=2500.0 + 127 * 20, conversation=1, start=1.0),  # misses TTFT
        rec(turn=2, error="HTTP 503", ttft=None, latency=None, conversation=1, start=5.0, action="pull"),
    ]
    s = point_stats(recs, rate=0.5, conversations=2, slo=SLO)
    assert (s.turns, s.errors) == (4, 1)
    assert s.attainment == pytest.approx(0.5)
    assert s.goodput == pytest.approx(2 / (2 / 0.5))  # 2 good turns over the 4 s the 2 conversations arrived in
    assert s.duration_s == pytest.approx(4.0 + 2.64)  # first sent to last ended
    assert s.goodput_wall == pytest.approx(2 / 6.64)
    assert s.ttft_first_p50 == pytest.approx(1400.0) and s.ttft_later_p50 == pytest.approx(100.0)
    assert s.itl_p99 == pytest.approx(20.0) and s.itl_max == pytest.approx(20.0)
    assert s.actions == {"decode_local": 1, "pull": 1}


def test_point_stats_in_simulated_time() -> None:
    s = point_stats(
        [rec(ttft=400.0, latency=400.0 + 127 * 40.0, itl=[40.0] * 127)],
        rate=1.0,
        conversations=1,
        slo=SLO,
        time_scale=2.0,
    )
    assert s.ttft_later_p50 == pytest.approx(200.0)
    assert s.tpot_p50 == pytest.approx(20.0) and s.itl_p50 == pytest.approx(20.0)


def test_nothing_measured_is_nan_not_an_error() -> None:
    s = point_stats([], rate=1.0, conversations=4, slo=SLO)
    assert s.turns == 0 and s.goodput == 0.0 and math.isnan(s.itl_p99) and math.isnan(s.attainment)


@pytest.mark.parametrize(("itl_p99", "out"), [(20.0, False), (60.0, False), (60.1, True), (math.nan, True)])
def test_colocated_collapses_past_twice_the_tpot_slo(itl_p99: float, out: bool) -> None:
    assert collapsed(itl_p99, SLO) is out


RATES = (0.5, 1.0, 2.0, 3.0, 4.0)


@pytest.mark.parametrize(
    ("done", "collapsed_at", "elapsed", "nxt"),
    [
        ([], None, 0.0, 0.5),
        ([0.5, 1.0], None, 10.0, 2.0),
        ([0.5, 1.0], 1.0, 10.0, 2.0),  # collapsed at 1: two more rates
        ([0.5, 1.0, 2.0], 1.0, 10.0, 3.0),
        ([0.5, 1.0, 2.0, 3.0], 1.0, 10.0, None),  # two past the collapse: stop
        (list(RATES), None, 10.0, None),  # all done
        ([0.5], None, 900.0, None),  # out of time
    ],
)
def test_the_sweep_stops_past_the_collapse_or_out_of_rates_or_time(
    done: list[float], collapsed_at: float | None, elapsed: float, nxt: float | None
) -> None:
    assert next_rate(RATES, done, collapsed_at, past=2, elapsed_s=elapsed, budget_s=900.0) == nxt


def test_geometric_rates() -> None:
    assert geometric_rates(0.5, 2.0, 4) == [0.5, 1.0, 2.0, 4.0]
    with pytest.raises(ValueError):
        geometric_rates(0.5, 1.0, 3)


# -- the suite: what runs, in what order, and the targets ------------------------------------------


def result(
    topology: str, config: str, rate: float, records: list[RequestRecord], conversations: int = 1
) -> ConfigResult:
    tags: dict[str, Any] = {
        "suite": "goodput",
        "topology": topology,
        "config": config,
        "rate": rate,
        "time_scale": 1.0,
        "slo": {"ttft_ms": 2000.0, "tpot_ms": 30.0},
    }
    return ConfigResult(
        name=suite.name(topology, config, rate),
        description="",
        target={},
        workload={"conversations": conversations},
        requests=records,
        wall_s=1.0,
        meta={"tags": tags},
        group=f"{topology} r{rate:g}",
    )


def test_the_sweep_runs_every_configuration_per_rate_and_stops_two_rates_past_the_collapse() -> None:
    opts = suite.SweepOptions(topologies=("1p1d",), rates=(0.5, 1.0, 2.0, 3.0, 4.0), past_collapse=2)
    done: list[ConfigResult] = []
    seen: list[str] = []
    gen: Iterator[Bench] = suite.sweep(opts, done, clock=lambda: 0.0)
    for b in gen:
        (plan,) = b.plans
        seen.append(plan.name)
        t = plan.tags
        itl = 200.0 if t["rate"] >= 1.0 else 20.0  # colocated collapses at 1 conversation/s
        done.append(result("1p1d", t["config"], t["rate"], [rec(itl=[itl] * 127)]))
    rates = sorted({float(n.rsplit("-r", 1)[1]) for n in seen})
    assert rates == [0.5, 1.0, 2.0, 3.0]
    assert seen[: len(suite.DEFAULT_CONFIGS)] == [suite.name("1p1d", c, 0.5) for c in suite.DEFAULT_CONFIGS]


def test_the_sweep_keeps_to_its_time_budget() -> None:
    ticks = iter([0.0, 0.0, 1000.0])
    opts = suite.SweepOptions(topologies=("1p1d",), rates=(0.5, 1.0), budget_s=900.0, configs=("plain",))
    names = [b.plans[0].name for b in suite.sweep(opts, [], clock=lambda: next(ticks))]
    assert names == ["1p1d-plain-r0.5"]


def test_configurations_deploy_as_described() -> None:
    opts = suite.SweepOptions(topologies=("2p2d",))
    co = suite.bench("2p2d", "colocated", 2.0, opts)
    assert (co.deployment.kind, co.deployment.replicas) == ("colocated", 4)
    assert not co.plans[0].workload.session_header
    plain = suite.bench("2p2d", "plain", 2.0, opts).deployment
    assert "--no-bidirectional" in plain.engine_flags and (plain.prefills, plain.decodes) == (2, 2)
    assert ("TURNKV_CONVERSATION_FROM_HISTORY", "false") in plain.gateway_env
    vm = suite.bench("2p2d", "vllm-multiturn", 2.0, opts).deployment
    assert vm.gateway_flags == ("--policy", "vllm-multiturn") and ("TURNKV_ROUTING", "round-robin") in vm.gateway_env
    ad = suite.bench("2p2d", "adaptive", 2.0, opts)
    params = json.loads(dict(ad.deployment.gateway_env)["TURNKV_POLICY__PARAMS"])
    # D's step, its streams' KV and P's queue come from the planner (reuse.load), read every second
    assert params == {"itl_budget_ms": 30.0, "decode_chunk_tokens": 64, "decode_cache_max_usage": 0.6}
    assert ("TURNKV_SCRAPE_INTERVAL_S", "1") in ad.deployment.gateway_env
    assert ("TURNKV_ROUTING", "load-affinity") in ad.deployment.gateway_env  # several P: by the turn's wait
    assert "TURNKV_ROUTING" not in dict(suite.bench("1p1d", "adaptive", 1.0, opts).deployment.gateway_env)
    assert build_policy("adaptive", params).name == "adaptive"  # the gateway accepts them
    assert "--long-prefill-token-threshold" in ad.deployment.decode_flags
    before = suite.bench("2p2d", "adaptive-no-itl", 2.0, opts).deployment
    assert "--long-prefill-token-threshold" not in before.decode_flags
    assert ad.plans[0].workload.session_header
    # the same conversations for every configuration at a rate; others at another rate
    seeds = {suite.bench("2p2d", c, 2.0, opts).plans[0].workload.seed for c in suite.CONFIGS}
    assert len(seeds) == 1 and suite.bench("2p2d", "plain", 4.0, opts).plans[0].workload.seed not in seeds
    assert opts.rates_for("2p2d")[0] == 2 * opts.rates_for("1p1d")[0]  # twice the engines, twice the rates


@pytest.mark.parametrize(
    ("config", "change"),
    [
        ("adaptive-before", {"prefill_crowding": 0}),  # before the P-queue charge
        ("adaptive-first", {"decode_local_first": True}),  # first turns on D while P is busy
    ],
)
def test_the_on_request_configurations_are_adaptive_with_one_change(config: str, change: dict[str, object]) -> None:
    # the same run can hold adaptive and each of them side by side
    opts = suite.SweepOptions(topologies=("2p2d",))
    assert config not in opts.configs  # on request only
    other = dict(suite.bench("2p2d", config, 2.0, opts).deployment.gateway_env)
    ad = dict(suite.bench("2p2d", "adaptive", 2.0, opts).deployment.gateway_env)
    b, a = json.loads(other["TURNKV_POLICY__PARAMS"]), json.loads(ad["TURNKV_POLICY__PARAMS"])
    assert b == {**a, **change}
    assert other["TURNKV_ROUTING"] == ad["TURNKV_ROUTING"] == "load-affinity"
    changed, adaptive = build_policy("adaptive", b), build_policy("adaptive", a)  # the gateway accepts them
    assert isinstance(changed, AdaptivePolicy) and isinstance(adaptive, AdaptivePolicy)
    assert {k: getattr(changed.p, k) for k in change} == change
    assert all(getattr(adaptive.p, k) != v for k, v in change.items())


def _point(goodput_turns: int, itl: float) -> list[RequestRecord]:
    """Records of a point with ``goodput_turns`` turns meeting the SLOs, and one that misses them."""
    good = [rec(conversation=i, itl=[itl] * 127) for i in range(goodput_turns)]
    return [*good, rec(conversation=99, ttft=5000.0, latency=5000.0 + 127 * 20.0)]


def test_the_targets_are_judged_per_rate_and_at_plain_pds_peak() -> None:
    # one conversation offered per point, so goodput is good turns x rate
    configs = [
        # rate 1: turnkv 10 good turns against colocated's 8 and plain's 6 (plain's peak: 6/s); ITL 1.05x plain
        result("1p1d", "colocated", 1.0, _point(8, 20.0)),
        result("1p1d", "plain", 1.0, _point(6, 20.0)),
        result("1p1d", "adaptive", 1.0, _point(10, 21.0)),
        # rate 2: plain 2 (4/s), colocated 9 beats turnkv's 7; turnkv's ITL 1.5x plain's
        result("1p1d", "colocated", 2.0, _point(9, 20.0)),
        result("1p1d", "plain", 2.0, _point(2, 20.0)),
        result("1p1d", "adaptive", 2.0, _point(7, 30.0)),
    ]
    checks = suite.checks(suite.grid(configs)[0])

    def check(target: str, where: str) -> suite.Check:
        return next(c for c in checks if c.target.startswith(target) and c.where.startswith(where))

    assert check("goodput >= best", "1p1d r1").verdict == "met"
    assert check("goodput >= best", "1p1d r1").measured == pytest.approx(10 / 8)
    assert check("goodput >= best", "1p1d r2").verdict == "MISSED"
    assert check("ITL p99", "1p1d r1").verdict == "met"
    assert check("ITL p99", "1p1d r2").verdict == "MISSED"
    peak = check("goodput >= 1.5x", "1p1d")
    assert peak.where == "1p1d r1" and peak.measured == pytest.approx(10 / 6) and peak.verdict == "met"
    text, groups = suite.analyze(configs)
    assert "| goodput >= 1.5x plain P/D where plain P/D peaks | 1p1d r1 | 1.67x | >= 1.50x | met |" in text
    assert set(groups) == {"1p1d r1", "1p1d r2"}


def test_the_summary_is_plain_json_without_the_records(tmp_path: Path) -> None:
    from turnkv.bench.records import RunResult

    run = RunResult(suite="goodput", command="turnkv bench scenarios --suite goodput")
    run.configs = [result("1p1d", "plain", 1.0, _point(3, 20.0)), result("1p1d", "adaptive", 1.0, [])]
    suite.write_summary(run, tmp_path / "summary.json")

    def no_constants(c: str) -> None:
        raise AssertionError(f"{c} in JSON")

    doc = json.loads((tmp_path / "summary.json").read_text(), parse_constant=no_constants)
    assert doc["points"]["1p1d"]["1"]["plain"]["goodput"] == pytest.approx(3.0)
    assert doc["points"]["1p1d"]["1"]["adaptive"]["itl_p99"] is None
    assert {t["verdict"] for t in doc["targets"]} <= {"met", "MISSED", "-"}
