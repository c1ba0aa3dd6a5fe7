"""What the engines' metrics and the turns' reports tell the fleet, and the snapshots it serves."""

from __future__ import annotations

import time

import pytest

from turnkv.engine.vllm.info import load_sample
from turnkv.gateway import fleet as fleet_module
from turnkv.gateway.fleet import MISSES_TO_SUSPEND, Fleet
from turnkv.routing import InstanceView

P = ["http://p0", "http://p1", "http://p2"]


def fleet() -> Fleet:
    return Fleet(P, ["http://d0"])


def apply(f: Fleet, url: str, metrics: str) -> None:
    sample = load_sample(metrics)
    assert sample is not None
    f.apply_load(url, sample)


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


def text(
    start: float = 100.0,
    hits: float = 0.0,
    bs: int = 16,
    pc: str = "True",
    n: int = 0,
    secs: float = 0.0,
    nbytes: float = 0.0,
) -> str:
    return METRICS.format(start=start, hits=hits, bs=bs, pc=pc, n=n, secs=secs, nbytes=nbytes)


def view(f: Fleet, url: str = "http://p0") -> InstanceView:
    v = f.view(url)
    assert v is not None
    return v


def test_metrics_restart_and_load() -> None:
    f = fleet()
    restarts: list[tuple[str, float | None]] = []
    f.on_restart = lambda v: restarts.append((v.url, v.epoch))
    apply(f, "http://p0", text(start=100.0))
    apply(f, "http://p0", text(start=100.0))
    v = view(f)
    assert restarts == [] and (v.epoch, v.running, v.kv_usage) == (100.0, 3, 0.5)
    apply(f, "http://p0", text(start=200.0))
    assert restarts == [("http://p0", 200.0)] and view(f).epoch == 200.0


PROGRESS = """# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {generated}
"""


def test_an_engine_whose_token_counters_moved_has_progressed() -> None:
    # what tells a busy engine from a stuck one (a first-token deadline is renewed for the busy)
    f = fleet()
    apply(f, "http://p0", text() + PROGRESS.format(prompt=100, generated=0))
    apply(f, "http://p0", text() + PROGRESS.format(prompt=100, generated=0))
    assert view(f).progressed_at == 0.0  # a first reading, then nothing computed since
    before = time.monotonic()
    apply(f, "http://p0", text() + PROGRESS.format(prompt=100, generated=5))
    moved = view(f).progressed_at
    assert moved >= before
    apply(f, "http://p0", text() + PROGRESS.format(prompt=100, generated=5))
    assert view(f).progressed_at == moved
    for _ in range(2):  # an engine that does not report them never shows progress
        apply(f, "http://p1", text())
    assert view(f, "http://p1").progressed_at == 0.0


@pytest.mark.parametrize(
    ("at_read", "now", "busy"),
    [
        (0, 0, 3),  # three of other clients
        (0, 3, 6),  # ... and three of ours sent since
        (3, 0, 0),  # the three were ours, and have ended: nothing runs there now (an agent's next turn)
        (3, 3, 3),  # ... still running
        (2, 7, 8),  # one of another client's, and seven of ours
    ],
)
def test_busy_counts_the_gateways_own_requests_now_and_others_as_last_read(at_read: int, now: int, busy: int) -> None:
    f = fleet()
    held = [f.hold("http://p0") for _ in range(at_read)]
    apply(f, "http://p0", text(start=100.0))  # the engine said 3 running at this read
    for s in held:
        s.release()
        s.release()  # a slot is given back once
    slots = [f.hold("http://p0") for _ in range(now)]
    assert view(f).busy == busy
    for s in slots:
        s.release()
    assert view(f).in_flight == 0


async def test_requests_sent_while_a_reading_is_under_way_may_be_in_its_counts() -> None:
    # the engine counts what runs when it answers, somewhere within the reading: a request of ours sent while
    # it was under way may be among its three, and one that ended meanwhile too; neither is another client's
    f = fleet()
    ended = f.hold("http://p0")

    class Engine:
        async def load(self, url: str) -> object:
            ended.release()
            f.hold("http://p0")
            return load_sample(text())

    await f.scrape(Engine(), "http://p0")  # type: ignore[arg-type]
    v = view(f)
    assert (v.in_flight, v.in_flight_scraped, v.busy) == (1, 2, 2)


def test_kv_in_use_now_counts_the_gateways_requests_and_pins_now() -> None:
    # D's KV 50% of 1,000 blocks x 16 at the read: 8,000 tokens, of which 3,000 were our stream's context and
    # 1,000 our pins; the stream has ended since and a pin of 2,000 been stored: others' 4,000 + ours 2,000
    f = fleet()
    stream = f.hold("http://d0", kv_tokens=3_000)
    f.pinned("http://d0", 1_000, None)
    apply(f, "http://d0", text().replace('engine=""', 'num_gpu_blocks="1000",engine=""'))
    stream.release()
    f.pinned("http://d0", 2_000, None)
    v = view(f, "http://d0")
    assert v.capacity_tokens == 16_000 and v.kv_usage == 0.5
    assert (v.others_kv_tokens, v.kv_usage_now) == (4_000, 6_000 / 16_000)


def test_link_samples_are_per_interval_means() -> None:
    f = fleet()
    samples: list[tuple[str, float, float, float]] = []
    f.on_link_sample = lambda role, b, s, c: samples.append((role, b, s, c))
    apply(f, "http://d0", text(n=2, secs=0.2, nbytes=2e6))
    apply(f, "http://d0", text(n=2, secs=0.2, nbytes=2e6))  # nothing new
    apply(f, "http://d0", text(n=6, secs=1.0, nbytes=10e6))
    assert samples == [("decode", 2e6, 0.2, 4)]


def test_prefix_cache_off_is_read_from_cache_config() -> None:
    f = fleet()
    apply(f, "http://p0", text(pc="False"))
    assert view(f).cache_factor == 0.0


def test_cache_factor_follows_observed_hits() -> None:
    f = fleet()
    apply(f, "http://p0", text(hits=0))
    f.expect_hits("http://p0", 1000)
    apply(f, "http://p0", text(hits=0))  # expected 1000 cached tokens, saw none
    assert view(f).cache_factor == 0.5
    f.expect_hits("http://p0", 1000)
    apply(f, "http://p0", text(hits=1000))
    assert view(f).cache_factor == 0.75


def test_capacity_is_read_from_cache_config() -> None:
    f = fleet()
    apply(f, "http://d0", text(bs=16))
    assert view(f, "http://d0").capacity_tokens is None  # the test's text names no num_gpu_blocks
    apply(f, "http://d0", text(bs=16).replace("enable_prefix_caching", 'num_gpu_blocks="100",enable_prefix_caching'))
    assert view(f, "http://d0").capacity_tokens == 1600


def test_missed_deadlines_suspend_an_engine_and_a_met_one_resets_the_count() -> None:
    f = fleet()
    for _ in range(MISSES_TO_SUSPEND - 1):
        f.missed_deadline("http://p0")
    f.met_deadline("http://p0")
    f.missed_deadline("http://p0")
    assert view(f).routable
    for _ in range(MISSES_TO_SUSPEND - 1):
        f.missed_deadline("http://p0")
    v = view(f)
    assert v.healthy and not v.routable


def test_a_snapshot_does_not_change_under_its_reader() -> None:
    f = fleet()
    before = f.views("prefill")
    slot = f.hold("http://p1")
    f.mark_failed("http://p2")
    assert [v.in_flight for v in before] == [0, 0, 0] and all(v.healthy for v in before)
    after = f.views("prefill")
    assert [v.in_flight for v in after] == [0, 1, 0] and not after[2].healthy
    slot.release()


def test_a_suspension_that_ran_out_is_seen_by_the_next_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module, "SUSPEND_S", 0.05)
    f = fleet()
    for _ in range(MISSES_TO_SUSPEND):
        f.missed_deadline("http://p0")
    assert not view(f).routable and view(f) is view(f)  # nothing changed: the same snapshot
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not view(f).routable:  # the clock, not a change, lifts it
        time.sleep(0.01)
    assert view(f).routable


def test_decode_local_prefills_count_until_their_first_token() -> None:
    f = Fleet(["http://p"], ["http://d"])
    a = f.hold("http://d", local_prefill=328)
    b = f.hold("http://d", local_prefill=64)
    c = f.hold("http://d")  # a P/D turn: D prefills nothing of it
    before = f.view("http://d")
    assert before is not None and (before.local_prefills, before.local_prefill_tokens, before.in_flight) == (2, 392, 3)
    a.prefilled()  # its first token came: its chunks no longer share D's steps
    a.prefilled()
    v = f.view("http://d")
    assert v is not None and (v.local_prefills, v.local_prefill_tokens, v.in_flight) == (1, 64, 3)
    assert (before.local_prefills, before.local_prefill_tokens) == (2, 392)  # the old snapshot stands
    b.release()  # ended before its first token
    c.release()
    a.release()
    v = f.view("http://d")
    assert v is not None and (v.local_prefills, v.local_prefill_tokens, v.in_flight) == (0, 0, 0)


def test_kv_in_use_now_counts_handles_given_up_on_until_d_frees_them() -> None:
    # D's KV 50% of 16,000 tokens at the read: 8,000, of which 2,000 a handle let go and 3,000 our stream's
    # context. The stream ends: its blocks stay pinned on D until its handle is released, so they still count
    f = fleet()
    f.let_go("http://d0", 2_000)
    stream = f.hold("http://d0", kv_tokens=3_000)
    apply(f, "http://d0", text().replace('engine=""', 'num_gpu_blocks="1000",engine=""'))
    stream.release()
    f.let_go("http://d0", 3_000)
    v = view(f, "http://d0")
    assert (v.others_kv_tokens, v.kv_usage_now) == (3_000, 8_000 / 16_000)
    f.let_go("http://d0", -5_000)  # both released: D freed them
    assert view(f, "http://d0").kv_usage_now == 3_000 / 16_000
