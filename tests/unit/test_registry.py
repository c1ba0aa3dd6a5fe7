"""Instance picking, and what the engines' metrics tell the registry."""

from __future__ import annotations

import pytest

from turnkv.engine.vllm.info import load_sample
from turnkv.gateway.registry import AFFINITY_SLACK, Instance, Registry

P = ["http://p0", "http://p1", "http://p2"]


def reg(routing: str = "affinity") -> Registry:
    return Registry(P, ["http://d0"], routing=routing)


def test_affinity_prefers_the_conversations_engine() -> None:
    r = reg()
    assert all(r.pick("prefill", prefer="http://p2").url == "http://p2" for _ in range(5))


def test_affinity_yields_to_load() -> None:
    r = reg()
    r.instances["http://p2"].in_flight = AFFINITY_SLACK + 1
    assert r.pick("prefill", prefer="http://p2").url != "http://p2"


def test_least_busy_and_round_robin_among_equals() -> None:
    r = reg()
    r.instances["http://p0"].in_flight = 3
    assert {r.pick("prefill").url for _ in range(10)} == {"http://p1", "http://p2"}


def test_unhealthy_and_excluded_are_avoided_while_others_remain() -> None:
    r = reg()
    r.mark_failed("http://p0")
    picks = {r.pick("prefill", exclude=frozenset({"http://p1"})).url for _ in range(5)}
    assert picks == {"http://p2"}
    r.mark_failed("http://p1")
    r.mark_failed("http://p2")
    assert r.pick("prefill") is not None  # all down: still try one rather than fail without trying
    assert r.pick("prefill", exclude=frozenset(P)) is None


@pytest.mark.parametrize("routing", ["least-loaded", "round-robin"])
def test_baselines_ignore_affinity(routing: str) -> None:
    r = reg(routing)
    assert len({r.pick("prefill", prefer="http://p2").url for _ in range(9)}) == 3


METRICS = """# TYPE process_start_time_seconds gauge
process_start_time_seconds {start}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{bs}",enable_prefix_caching="{pc}",engine=""}} 1.0
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_count{{engine="0",model_name="m"}} {n}
vllm:nixl_xfer_time_seconds_sum{{engine="0",model_name="m"}} {secs}
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_count{{engine="0",model_name="m"}} {n}
vllm:nixl_bytes_transferred_sum{{engine="0",model_name="m"}} {nbytes}
"""


def text(start: float = 100.0, hits: float = 0.0, bs: int = 16, pc: str = "True", n: int = 0, secs: float = 0.0,
         nbytes: float = 0.0) -> str:
    return METRICS.format(start=start, hits=hits, bs=bs, pc=pc, n=n, secs=secs, nbytes=nbytes)


def apply(r: Registry, inst: Instance, metrics: str) -> None:
    sample = load_sample(metrics)
    assert sample is not None
    r.apply_load(inst, sample)


def test_metrics_restart_and_load() -> None:
    r = reg()
    restarts: list[str] = []
    r.on_restart = lambda inst: restarts.append(inst.url)
    inst = r.instances["http://p0"]
    apply(r, inst, text(start=100.0))
    apply(r, inst, text(start=100.0))
    assert restarts == [] and (inst.epoch, inst.running, inst.kv_usage) == (100.0, 3, 0.5)
    apply(r, inst, text(start=200.0))
    assert restarts == ["http://p0"] and inst.epoch == 200.0


@pytest.mark.parametrize(("in_flight", "busy"), [(0, 3), (3, 3), (7, 7)])
def test_busy_is_the_engines_count_or_the_gateways_own_when_more(in_flight: int, busy: int) -> None:
    r = reg()
    inst = r.instances["http://p0"]
    apply(r, inst, text(start=100.0))  # the engine said 3 running at its last scrape
    inst.in_flight = in_flight
    assert inst.busy == busy


def test_link_samples_are_per_interval_means() -> None:
    r = reg()
    samples: list[tuple[str, float, float, float]] = []
    r.on_link_sample = lambda role, b, s, c: samples.append((role, b, s, c))
    inst = r.instances["http://d0"]
    apply(r, inst, text(n=2, secs=0.2, nbytes=2e6))
    apply(r, inst, text(n=2, secs=0.2, nbytes=2e6))  # nothing new
    apply(r, inst, text(n=6, secs=1.0, nbytes=10e6))
    assert samples == [("decode", 2e6, 0.2, 4)]


def test_prefix_cache_off_is_read_from_cache_config() -> None:
    r = reg()
    inst = r.instances["http://p0"]
    apply(r, inst, text(pc="False"))
    assert inst.cache_factor == 0.0


def test_cache_factor_follows_observed_hits() -> None:
    r = reg()
    inst = r.instances["http://p0"]
    apply(r, inst, text(hits=0))
    r.expect_hits("http://p0", 1000)
    apply(r, inst, text(hits=0))  # expected 1000 cached tokens, saw none
    assert inst.cache_factor == 0.5
    r.expect_hits("http://p0", 1000)
    apply(r, inst, text(hits=1000))
    assert inst.cache_factor == 0.75
