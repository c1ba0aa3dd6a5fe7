"""``turnkv sim`` flags, and the cost model's fixed points (KV bytes per token, link presets)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from turnkv.sim.costs import LINKS, CostModel, kv_bytes_per_token
from turnkv.sim.settings import SimSettings, add_sim_arguments, settings_from_args


def parse(*argv: str) -> SimSettings:
    p = argparse.ArgumentParser()
    add_sim_arguments(p)
    return settings_from_args(p.parse_args(list(argv)))


def test_defaults_are_vllm_defaults() -> None:
    s = parse()
    e = s.engine
    assert (e.role, e.compat, e.block_size, e.prefix_caching, e.bidirectional) == ("colocated", "0.26", 16, True, True)
    assert (e.kv_recompute_threshold, e.decoder_kv_blocks_ttl, e.kv_lease_duration) == (64, 480.0, 30.0)
    assert e.kv_load_failure_policy == "fail" and s.template == "keep" and s.version == "0.26.0"


@pytest.mark.parametrize(
    ("argv", "path", "value"),
    [
        (["--role", "prefill"], "engine.role", "prefill"),
        (["--vllm-compat", "0.33"], "version", "0.33.0"),
        (["--template", "strip"], "template", "strip"),
        (["--chat-template", "/x/t.jinja"], "chat_template", "/x/t.jinja"),
        (["--no-prefix-caching"], "engine.prefix_caching", False),
        (["--no-bidirectional"], "engine.bidirectional", False),
        (["--kv-recompute-threshold", "0"], "engine.kv_recompute_threshold", 0),
        (["--decoder-kv-blocks-ttl", "4"], "engine.decoder_kv_blocks_ttl", 4.0),
        (["--kv-lease-duration", "10"], "engine.kv_lease_duration", 10.0),
        (["--kv-load-failure-policy", "recompute"], "engine.kv_load_failure_policy", "recompute"),
        (["--block-size", "32"], "engine.block_size", 32),
        (["--num-gpu-blocks", "64"], "engine.num_blocks", 64),
        (["--retokenize-drift"], "retokenize_drift", True),
        (["--no-thinking"], "thinking", False),
        (["--time-scale", "0"], "engine.costs.time_scale", 0.0),
        (["--link", "rdma400"], "engine.costs.link", "rdma400"),
        (["--link-gbps", "2"], "engine.costs.link_bytes_per_s", 2e9),
        (["--link-latency-ms", "3"], "engine.costs.link_fixed_s", 0.003),
        (["--decode-itl-ms", "20"], "engine.costs.decode_base_s", 0.02),
        (["--decode-per-seq-us", "70"], "engine.costs.decode_per_seq_s", 70e-6),
        (["--decode-ctx-ns", "40"], "engine.costs.decode_per_ctx_token_s", 40e-9),
        (["--prefill-us-per-token", "20"], "engine.costs.prefill_per_token_s", 20e-6),
        (["--prefill-attn-ns", "2"], "engine.costs.prefill_attn_s", 2e-9),
        (["--free-tokens", "256"], "engine.costs.free_tokens", 256),
        (["--prefill-floor-ms", "10"], "engine.costs.prefill_floor_s", 0.01),
        (["--fail-next", "2"], "faults.fail_next", 2),
        (["--drop-next", "1", "--drop-after-chunks", "5"], "faults.drop_after_chunks", 5),
        (["--seed", "7"], "engine.seed", 7),
    ],
)
def test_flags(argv: list[str], path: str, value: Any) -> None:
    obj: Any = parse(*argv)
    for part in path.split("."):
        obj = getattr(obj, part)
    assert obj == value


def test_kv_bytes_per_token_of_the_qwen3_8b_shape_is_144_kib() -> None:
    assert kv_bytes_per_token("qwen3-8b") == 144 * 1024
    assert CostModel().kv_bytes_per_token == 144 * 1024


@pytest.mark.parametrize(
    ("link", "gb_per_s"), [("host", 0.43), ("h200-ipc", 20.0), ("100gbe", 11.0), ("rdma400", 45.0), ("nvlink", 300.0)]
)
def test_transfer_time_is_a_fixed_cost_plus_bytes_over_bandwidth(link: str, gb_per_s: float) -> None:
    model = CostModel(link=link)
    one_gb = model.transfer_link().seconds(10**9) - model.transfer_link().seconds(0)
    assert one_gb == pytest.approx(1 / gb_per_s)
    assert model.transfer_link().seconds(0) == LINKS[link].fixed_s > 0
    assert CostModel(link=link, link_bytes_per_s=1e9).transfer_link().seconds(10**9) == pytest.approx(
        1 + LINKS[link].fixed_s
    )


def test_prefill_grows_with_new_tokens_and_context_and_time_scale_zero_is_free() -> None:
    m = CostModel()
    assert m.prefill_s(0, 100) == 0.0
    assert m.prefill_s(1, 0) == pytest.approx(m.decode_base_s)  # one token costs a step's fixed cost
    assert CostModel(prefill_floor_s=0.01).prefill_s(1, 0) == 0.01
    assert m.prefill_s(4096, 0) < m.prefill_s(8192, 0)
    assert m.prefill_s(4096, 0) < m.prefill_s(4096, 8192)
    assert m.decode_s(1) < m.decode_s(64)
    assert CostModel(time_scale=0).scaled(m.prefill_s(8192, 8192)) == 0.0
