"""The doctor's figures: link lines, P's compute, bytes per token, the break-even and the path's expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnkv.doctor import host, link
from turnkv.doctor.facts import EngineFacts, HostFacts, Sample, SizeRun
from turnkv.engine.diagnostics import EngineDescription
from turnkv.reuse.cost import CostParams

BPT = 147456


def samples(fixed_s: float, bw: float, sizes: tuple[int, ...]) -> list[Sample]:
    return [Sample(n, n * BPT, fixed_s + n * BPT / bw, 1) for n in sizes]


@pytest.mark.parametrize(
    ("fixed_s", "bw"), [(0.002, 0.43e9), (0.002, 20e9), (0.010, 11e9), (0.005, 45e9), (0.002, 300e9)]
)
def test_a_line_through_three_sizes_gives_the_link_back(fixed_s: float, bw: float) -> None:
    fit = link.fit_link(samples(fixed_s, bw, (2032, 8176, 32752)))
    assert fit is not None and fit.line
    assert fit.bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert fit.fixed_s == pytest.approx(fixed_s, abs=1e-9)


def test_one_size_gives_the_mean_rate_and_no_fixed_cost() -> None:
    fit = link.fit_link(samples(0.002, 1e9, (8192,)))
    assert fit is not None and not fit.line
    assert fit.fixed_s == 0.0
    assert fit.bytes_per_s == pytest.approx(8192 * BPT / (0.002 + 8192 * BPT / 1e9))


def test_transfers_mixed_with_live_traffic_count_as_their_mean() -> None:
    # two transfers in one reading (the probe's and a client's): the mean point, weighted by two
    mixed = Sample(8192, 2 * 8192 * BPT, 2 * (0.002 + 8192 * BPT / 1e9), 2)
    fit = link.fit_link([*samples(0.002, 1e9, (2048, 32768)), mixed])
    assert fit is not None and fit.bytes_per_s == pytest.approx(1e9, rel=1e-6)


def test_no_transfer_no_fit() -> None:
    assert link.fit_link([]) is None
    assert link.fit_link([Sample(2048, 0.0, 0.0, 1)]) is None


def cold(n: int, hop: float = 0.003, a: float = 25e-6, b: float = 1.2e-9) -> float:
    return hop + a * n + b * n * n / 2


def test_p_compute_from_three_cold_prefills() -> None:
    runs = [SizeRun(n, prefill_s=cold(n)) for n in (2048, 8192, 32768)]
    c = link.fit_compute(runs, CostParams())
    assert c is not None
    assert (c.hop_ms, c.us_per_token, c.attn_ns) == pytest.approx((3.0, 25.0, 1.2), rel=1e-3)


def test_p_compute_from_two_keeps_the_prior_attention() -> None:
    prior = CostParams(prefill_attn_s=1.2e-9)
    c = link.fit_compute([SizeRun(n, prefill_s=cold(n, hop=0.010, a=30e-6)) for n in (2048, 8192)], prior)
    assert c is not None
    assert (c.hop_ms, c.us_per_token, c.attn_ns) == pytest.approx((10.0, 30.0, 1.2), rel=1e-3)


def test_p_compute_from_one_keeps_the_prior_hop_and_attention() -> None:
    c = link.fit_compute([SizeRun(8192, prefill_s=cold(8192, a=40e-6))], CostParams())
    assert c is not None and c.us_per_token == pytest.approx(40.0, rel=1e-3)


def test_bytes_per_token_counts_whole_blocks_of_single_transfers() -> None:
    # 2040 tokens move as 128 blocks of 16; a reading with two transfers in it says nothing of one
    got = link.kv_bytes_per_token([Sample(2040, 2048 * BPT, 0.1, 1), Sample(100, 1e12, 1.0, 2)], 16)
    assert got == BPT
    assert link.kv_bytes_per_token([], 16) is None


def params(fixed_s: float, bw: float) -> CostParams:
    return CostParams(link_fixed_s=fixed_s, link_bytes_per_s=bw)


# The simulator's presets, and which of always-pull and never-pull won turn 5 in the fifth-turn suite
# (BENCHMARKS.md, "Fifth-turn TTFT on the simulator", P's cache cold): on `host` never-pull at every history
# (2k-32k); on every faster link always-pull at 16k, and on rdma400 (the one fast link swept) from 2k up.
@pytest.mark.parametrize(
    ("fixed_s", "bw", "longest_loss"),
    [(0.002, 0.43e9, None), (0.002, 20e9, 16000), (0.010, 11e9, 16000), (0.005, 45e9, 2000), (0.002, 300e9, 16000)],
)
def test_the_break_even_agrees_with_the_fifth_turn_suite(fixed_s: float, bw: float, longest_loss: int | None) -> None:
    be = link.break_even(params(fixed_s, bw), 150, 40960, 16)
    if longest_loss is None:
        assert be is None  # a pull never pays: never-pull won
    else:
        assert be is not None and be < longest_loss  # always-pull won at that history
        assert not link.pull_pays(params(fixed_s, bw), be - 16, 150, 16)
        assert link.pull_pays(params(fixed_s, bw), be, 150, 16)


def test_no_room_for_history_no_break_even() -> None:
    assert link.break_even(params(0.002, 300e9), 150, 100, 16) is None


def engine(url: str, gpus: frozenset[str] = frozenset(), local: bool = True) -> EngineFacts:
    d = EngineDescription(
        version="0.26.0",
        plugin=None,
        gpus=gpus,
        models=(),
        block_size=16,
        num_blocks=100,
        prefix_caching=True,
        memory_share=None,
        tokenizer=True,
        tokenizer_detail="",
        takes_prompt_ids=False,
        stream_handles=None,
        transfer=None,
    )
    return EngineFacts(url, "prefill", d, local=local)


TOPO = """\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tSYS\t0-47\t0
GPU1\tNV18\t X \tSYS\t0-47\t0
GPU2\tSYS\tSYS\t X \t48-95\t1

Legend:
  X    = Self
"""
P2P = """ \tGPU0\tGPU1\tGPU2\t
 GPU0\tX\tOK\tOK\t
 GPU1\tOK\tX\tNS\t
 GPU2\tOK\tNS\tX\t
"""
UUIDS = "0, GPU-a\n1, GPU-b\n2, GPU-c\n"


def topology() -> HostFacts:
    return HostFacts(
        nvidia_smi=True,
        uuids=host.parse_uuids(UUIDS),
        p2p=host.parse_matrix(P2P),
        topology=host.parse_matrix(TOPO),
    )


def test_nvidia_smi_matrices_are_read_by_gpu_pair() -> None:
    h = topology()
    assert h.uuids == {"GPU-a": 0, "GPU-b": 1, "GPU-c": 2}
    assert h.topology[(0, 1)] == "NV18" and h.topology[(0, 2)] == "SYS" and h.topology[(1, 1)] == "X"
    assert h.p2p[(0, 2)] == "OK" and h.p2p[(1, 2)] == "NS"


@pytest.mark.parametrize(
    ("pg", "dg", "path", "floor"),
    [
        ("GPU-a", "GPU-a", "one GPU", 10e9),
        ("GPU-a", "GPU-b", "NVLink", 50e9),
        ("GPU-a", "GPU-c", "PCIe peer-to-peer", 10e9),
        ("GPU-b", "GPU-c", "host memory", 5e9),
    ],
)
def test_the_path_between_the_gpus_sets_what_the_link_should_do(pg: str, dg: str, path: str, floor: float) -> None:
    e = link.expect(
        engine("http://127.0.0.1:1", frozenset({pg})), engine("http://127.0.0.1:2", frozenset({dg})), topology()
    )
    assert (e.path, e.floor_bytes_per_s, e.same_host) == (path, floor, True)


def test_without_gpus_or_topology_only_tcp_speed_is_flagged() -> None:
    e = link.expect(engine("http://a:1", local=False), engine("http://b:2", local=False), HostFacts())
    assert (e.path, e.floor_bytes_per_s, e.same_host) == ("unknown", None, None)
    assert link.far_below(0.45e9, e) == "below 1 GB/s: KV most likely moves over TCP"
    assert link.far_below(5e9, e) is None
    same = link.expect(engine("http://a:1", local=False), engine("http://a:2", local=False), HostFacts())
    assert same.same_host is True and same.floor_bytes_per_s is None


def test_a_rate_far_below_the_path_is_flagged() -> None:
    e = link.Expectation("one GPU", 10e9, True, "")
    assert link.far_below(2.4e9, e) is not None
    assert link.far_below(5e9, e) is None


def test_loopback_urls_are_this_machine() -> None:
    assert host.is_local("http://127.0.0.1:8100")
    assert host.is_local("http://localhost:8100/")
    assert host.is_local("http://[::1]:8100")
    assert not host.is_local("http://192.0.2.1:8100")  # TEST-NET: never this machine


def test_rdma_devices_are_listed_where_the_kernel_has_them(tmp_path: Path) -> None:
    (tmp_path / "mlx5_0").mkdir()
    assert host.rdma_devices(tmp_path) == ("mlx5_0",)
    assert host.rdma_devices(tmp_path / "none") == ()
