"""The reliability suite's parts that need no deployment: the /proc sampler, the load generator's
open-file limit, and how the report reads samples and decision headers."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator

import pytest

from turnkv.bench.records import ConfigResult, RequestRecord
from turnkv.bench.runner import FD_RESERVE, ensure_fd_room
from turnkv.bench.sampler import ResourceSampler, Series, open_fds, rss_bytes, tree_usage
from turnkv.bench.scenarios import reliability


def test_open_fds_counts_what_this_process_opens() -> None:
    before = open_fds(os.getpid())
    files = [open(os.devnull) for _ in range(5)]  # noqa: SIM115 - closed below
    try:
        assert open_fds(os.getpid()) == before + 5
    finally:
        for f in files:
            f.close()
    assert open_fds(os.getpid()) == before
    assert rss_bytes(os.getpid()) > 1 << 20


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    """A child that holds 20 extra descriptors open until its stdin closes."""
    code = "import os,sys; fs=[open(os.devnull) for _ in range(20)]; print('ready', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(10)
    proc.stdout.close()


def test_a_tree_counts_its_children(child: subprocess.Popen[str]) -> None:
    own_rss, own_fds = tree_usage(os.getpid(), children=False)
    tree_rss, tree_fds = tree_usage(os.getpid(), children=True)
    assert tree_fds - own_fds >= 20
    assert tree_rss > own_rss


def test_the_sampler_samples_each_group_and_stops(child: subprocess.Popen[str]) -> None:
    sampler = ResourceSampler({"me": (os.getpid(), False), "child": (child.pid, False)}, interval_s=0.05)
    sampler.start()
    sampler.stop(timeout_s=10)
    for name in ("me", "child"):
        s = sampler.series[name]
        assert len(s.t) >= 2 and s.t == sorted(s.t)  # the thread's first sample and the one at stop
        assert len(s.t) == len(s.rss_mib) == len(s.fds)
    assert min(sampler.series["child"].fds) >= 20
    d = sampler.to_dict(load_start_s=0.0)
    assert Series.from_dict(d["series"]["me"]).fds == sampler.series["me"].fds
    with pytest.raises(ValueError):
        ResourceSampler({}, interval_s=0)


def test_the_load_generator_raises_its_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2000 + FD_RESERVE:
        pytest.skip("the hard open-file limit is below what this test asks for")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        assert ensure_fd_room(2000) == 2000 + FD_RESERVE
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 2000 + FD_RESERVE
        assert ensure_fd_room(10) == 2000 + FD_RESERVE  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_hard_limit_too_low_is_a_clear_refusal() -> None:
    code = (
        "import resource\n"
        "from turnkv.bench.runner import ensure_fd_room\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 400))\n"
        "try:\n    ensure_fd_room(1000)\nexcept ValueError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "1000 concurrent connections need 1256 open files; the hard limit is 400" in out.stdout, out.stderr


def _series(rss: list[float], fds: list[int]) -> Series:
    return Series(t=[float(i) for i in range(len(rss))], rss_mib=rss, fds=fds)


def test_flat_samples_are_not_flagged_and_growth_is() -> None:
    n = 121  # load from 0 to 120 s: warm-up 30 s, windows 30-40 s and 110-120 s
    flat = reliability.growth(
        "gw", _series([100.0 + (i % 3) for i in range(n)], [500 + i % 7 for i in range(n)]), 0, 120
    )
    assert not flat.rss_flag and not flat.fd_flag
    assert flat.rss_range == (100.0, 102.0) and flat.fd_range == (500, 506)
    # a leak: 1 MiB and 2 fds a second, past the warm-up
    leak = reliability.growth("gw", _series([100.0 + i for i in range(n)], [500 + 2 * i for i in range(n)]), 0, 120)
    assert leak.rss_flag and leak.fd_flag
    assert leak.after_warm_up == (135.0, 570.0) and leak.end_of_load == (215.0, 730.0)
    # the wind-down after the last new request (fewer streams open) does not hide growth before it
    rising_then_idle = [100.0 + i if i <= 100 else 60.0 for i in range(n)]
    assert reliability.growth("gw", _series(rising_then_idle, [500] * n), 0, 120, steady_end=100).rss_flag
    assert not reliability.growth("gw", _series(rising_then_idle, [500] * n), 0, 120).rss_flag
    # a warm-up that grows and then holds is not a leak
    warm = [100.0 + min(i, 30) * 3 for i in range(n)]
    assert not reliability.growth("gw", _series(warm, [500] * n), 0, 120).rss_flag


def test_open_streams_from_records() -> None:
    recs = [
        RequestRecord(conversation=0, turn=1, start_s=0.0, latency_ms=2000.0),
        RequestRecord(conversation=1, turn=1, start_s=1.0, latency_ms=2000.0),
        RequestRecord(conversation=2, turn=1, start_s=1.0, error="HTTP 503: busy", status=503),
    ]
    assert reliability.open_streams(recs, [-1.0, 0.5, 1.5, 2.5, 3.5]) == [0, 1, 2, 1, 0]


def test_the_report_counts_store_reasons_and_error_kinds() -> None:
    def rec(i: int, reason: str, error: str | None = None) -> RequestRecord:
        return RequestRecord(
            conversation=i,
            turn=2,
            start_s=0.0,
            ttft_ms=10.0,
            latency_ms=20.0,
            itl_ms=[1.0],
            error=error,
            decision={"outcome": "stateless" if reason.startswith("store") else "full", "reason": reason},
        )

    recs = [
        rec(0, "store_busy"),
        rec(1, "store_unavailable"),
        rec(2, "pull"),
        rec(3, "pull", "TimeoutError: "),
        rec(4, "pull", "HTTP 503: {...}"),
    ]
    c = ConfigResult(
        name="r",
        description="",
        workload={"concurrency": 5},
        target={},
        requests=recs,
        wall_s=1.0,
        meta={
            "resources": {
                "load_start_s": 0.0,
                "load_end_s": 60.0,
                "series": {"gateway": _series([50.0] * 61, [40] * 61).to_dict()},
            }
        },
    )
    text, groups = reliability.analyze([c])
    assert "because of the store (store_unavailable / store_busy): **2**" in text
    assert "failed: 2 (" in text and "TimeoutError 1" in text and "HTTP 503 1" in text
    assert "| gateway | 50 / 40 |" in text and "none flagged" in text
    assert groups == {"reliability": ["r"]}
