"""The shared-GPU suite's report: D's pinned KV as a time-average of what the load left pinned, every stream's
ITL, later turns' TTFT, and turnkv's ratios to plain P/D wave by wave."""

from __future__ import annotations

import pytest

from turnkv.bench.records import ConfigResult, RequestRecord
from turnkv.bench.scenarios import shared_gpu
from turnkv.bench.watch import time_average


def config(name: str, itl: list[float], ttft2: float, pinned: list[tuple[float, float]]) -> ConfigResult:
    recs = [
        RequestRecord(conversation=0, turn=1, start_s=0.0, ttft_ms=900.0, itl_ms=itl),
        RequestRecord(conversation=0, turn=2, start_s=1.0, ttft_ms=ttft2, itl_ms=itl),
        RequestRecord(conversation=1, turn=2, start_s=1.0, error="timeout"),
    ]
    target = {"engine_flags": ["--vllm-compat", "0.33", "--num-gpu-blocks", "100"]}  # 1,600 tokens
    meta = {"watched": {"decode": {"sim:pinned_tokens": pinned}}}
    return ConfigResult(name, "", {}, target, recs, 1.0, meta=meta)


def test_a_time_average_holds_each_reading_until_the_next() -> None:
    assert time_average([]) is None
    assert time_average([(0.0, 5.0)]) == 5.0
    assert time_average([(0.0, 0.0), (1.0, 100.0), (4.0, 0.0)]) == pytest.approx(75.0)  # 100 for 3 s of 4


def test_ds_pinned_share_is_over_its_kv_size() -> None:
    c = config("turnkv-wave1", [10.0], 100.0, [(0.0, 0.0), (1.0, 800.0), (2.0, 0.0)])
    avg, peak = shared_gpu.pinned_share(c)
    assert avg == pytest.approx(0.25) and peak == 0.5
    assert shared_gpu.pinned_share(config("x", [10.0], 100.0, [])) != shared_gpu.pinned_share(c)


def test_ratios_and_the_report() -> None:
    t = config("turnkv-wave1", [10.0, 20.0, 30.0], 100.0, [(0.0, 160.0), (1.0, 160.0)])
    p = config("plain-wave1", [10.0, 10.0, 15.0], 400.0, [(0.0, 0.0), (1.0, 0.0)])
    r = shared_gpu.ratios(t, p)
    assert r["itl_max"] == 2.0 and r["later_ttft_p50"] == 0.25
    assert r["itl_p99"] == pytest.approx(29.8 / 14.9)
    text, groups = shared_gpu.analyze([t, p])
    assert groups == {"shared gpu": ["turnkv-wave1", "plain-wave1"]}
    assert "| turnkv-wave1 | 2/3 |" in text and "10.0%" in text  # answered; 160 of 1,600 tokens pinned
    assert "| wave 1 | 2.00x | 2.00x | 0.25x |" in text
