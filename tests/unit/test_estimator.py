"""Online estimates of the link and of prefill speed."""

from __future__ import annotations

import random

import pytest

from turnkv.reuse.cost import CostParams, transfer_s
from turnkv.reuse.estimator import CostEstimator, LinkEstimator, PrefillEstimator


def test_link_without_samples_is_the_prior() -> None:
    assert LinkEstimator(0.004, 0.45e9).params() == (0.004, 0.45e9)


def test_link_fit_recovers_fixed_cost_and_bandwidth() -> None:
    est = LinkEstimator(0.1, 1e9)
    for nbytes in (1e6, 5e6, 2e7, 8e7, 3e8):
        est.observe(nbytes, 0.02 + nbytes / 5e9, 3)
    fixed, bw = est.params()
    assert fixed == pytest.approx(0.02, rel=1e-6)
    assert bw == pytest.approx(5e9, rel=1e-6)


def test_link_with_one_size_keeps_the_prior_fixed_cost() -> None:
    est = LinkEstimator(0.004, 1e9)
    est.observe(45e6, 0.004 + 0.1, 1)
    assert est.params() == pytest.approx((0.004, 4.5e8))


def test_link_ignores_empty_intervals() -> None:
    est = LinkEstimator(0.004, 1e9)
    est.observe(0, 0, 0)
    assert est.samples == 0


def test_prefill_fit_recovers_the_model() -> None:
    prior = CostParams()
    est = PrefillEstimator(prior, min_samples=4)
    for new, ctx in ((100, 0), (500, 1000), (2000, 4000), (4000, 0), (8000, 8000), (300, 16000)):
        est.observe(new, ctx, 0.003 + 30e-6 * new + 2e-9 * new * (ctx + new / 2))
    hop, per_token, attn = est.params()
    assert hop == pytest.approx(0.003, abs=1e-6)
    assert per_token == pytest.approx(30e-6, rel=1e-4)
    assert attn == pytest.approx(2e-9, rel=1e-3)


def test_prefill_needs_varied_samples() -> None:
    prior = CostParams()
    est = PrefillEstimator(prior, min_samples=2)
    for _ in range(10):
        est.observe(500, 0, 1.0)
    assert est.params() == (prior.hop_s, prior.prefill_per_token_s, prior.prefill_attn_s)


def test_cost_estimator_combines_both() -> None:
    est = CostEstimator(CostParams())
    for nbytes in (1e6, 1e7, 1e8):
        est.observe_link("prefill", nbytes, 0.001 + nbytes / 50e9, 1)
    p = est.params()
    assert p.link_bytes_per_s == pytest.approx(50e9, rel=1e-6)
    assert p.push_bytes_per_s == pytest.approx(50e9, rel=1e-6)  # never measured: borrowed
    assert p.kv_bytes_per_token == CostParams().kv_bytes_per_token


def test_link_directions_are_learnt_apart() -> None:
    est = CostEstimator(CostParams())
    for nbytes in (1e6, 1e7, 1e8):
        est.observe_link("decode", nbytes, 0.002 + nbytes / 300e9, 1)  # D reads P's blocks: P -> D
    p = est.params()
    # nothing pulled yet: the pull estimate borrows P -> D's (the first pull then measures it)
    assert p.link_bytes_per_s == pytest.approx(300e9, rel=1e-6) and est.pull.samples == 0
    for nbytes in (1e6, 1e7, 1e8):
        est.observe_link("prefill", nbytes, 0.002 + nbytes / 5e9, 1)  # P pulls D's blocks
    p = est.params()
    assert p.link_bytes_per_s == pytest.approx(5e9, rel=1e-6)
    assert p.push_bytes_per_s == pytest.approx(300e9, rel=1e-6)
    assert transfer_s(p, 16000) > 10 * transfer_s(p, 16000, push=True)


def test_configured_directions_stand_until_measured() -> None:
    est = CostEstimator(CostParams(link_bytes_per_s=5e9, push_fixed_s=0.001, push_bytes_per_s=200e9))
    p = est.params()
    assert (p.link_bytes_per_s, p.push_bytes_per_s, p.push_fixed_s) == (5e9, 200e9, 0.001)
    est.observe_link("prefill", 1e8, 0.02, 1)
    assert est.params().push_bytes_per_s == 200e9  # configured, so not borrowed from the pulls


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_link_measurement_older_than_its_age_no_longer_counts() -> None:
    # pulls measured slow under contention, then none for a while: the estimate goes back to what a
    # direction never measured gets (the other direction's), so pulls that pay are tried, and measured, again
    clock = Clock()
    est = CostEstimator(CostParams(), link_max_age_s=30.0, clock=clock)
    for _ in range(5):
        est.observe_link("decode", 45e6, 0.001 + 45e6 / 50e9, 1)  # D reads P's blocks after every P leg
        est.observe_link("prefill", 45e6, 0.001 + 45e6 / 0.5e9, 1)  # P's pulls, contended
    contended = est.links()["pull"].bytes_per_s
    assert contended == pytest.approx(0.5e9, rel=0.02)
    clock.now += 20.0
    est.observe_link("decode", 45e6, 0.001 + 45e6 / 50e9, 1)  # the push direction goes on being measured
    clock.now += 15.0  # the pulls are 35 s old, the last push 15 s
    links = est.links()
    assert links["pull"].samples == 0 and links["push"].samples == 1
    assert links["pull"].bytes_per_s == links["push"].bytes_per_s > 10 * contended


def test_without_an_age_a_link_measurement_stays() -> None:
    clock = Clock()
    est = LinkEstimator(0.001, 1e9, clock=clock)
    est.observe(45e6, 0.001 + 45e6 / 0.5e9, 1)
    clock.now += 1e6
    assert est.samples == 1 and est.params() == pytest.approx((0.001, 0.5e9))


def test_pulls_of_one_size_take_the_bandwidth_of_the_direction_fitted_from_varied_sizes() -> None:
    # P's pulls fetch only the last answer's blocks (P's cache holds the rest): all ~21 MB, 4.8 ms each,
    # on a 20 GB/s link with 3.75 ms of fixed overhead. Put on the bytes, the overhead reads as ~7 GB/s, and
    # a whole-history pull (1.25 GB) is priced at ~170 ms instead of ~66. D's reads of P's blocks come in
    # varied sizes and fit a line: the pulls take its bandwidth and the fixed cost their own times imply.
    est = CostEstimator(CostParams(link_fixed_s=0.002))
    for nbytes in (3e8, 1e9, 1.25e9, 5e7):
        est.observe_link("decode", nbytes, 0.00375 + nbytes / 20e9, 1)
    for _ in range(5):
        est.observe_link("prefill", 21e6, 0.00375 + 21e6 / 20e9, 1)
    pull = est.links()["pull"]
    assert pull.bytes_per_s == pytest.approx(20e9, rel=1e-6)
    assert pull.fixed_s == pytest.approx(0.00375, rel=1e-6)
    assert transfer_s(est.params(), 8500, 16) < 0.1  # a whole-history pull: ~66 ms, not ~170


def test_pulls_of_one_size_keep_their_own_estimate_when_nothing_is_fitted() -> None:
    est = CostEstimator(CostParams(link_fixed_s=0.002))
    for _ in range(5):
        est.observe_link("decode", 3e8, 0.002 + 3e8 / 100e9, 1)  # one size this way too: nothing fitted
        est.observe_link("prefill", 21e6, 0.002 + 21e6 / 20e9, 1)
    assert est.links()["pull"].bytes_per_s == pytest.approx(20e9, rel=1e-6)


@pytest.mark.parametrize("seed", range(20))
def test_params_asked_every_turn_are_what_a_fit_of_everything_so_far_gives(seed: int) -> None:
    """``params`` is fitted again only when something changed; the oracle is a new estimator given every
    measurement so far at the same times, whose first answer is a fit by construction."""
    rng = random.Random(seed)
    clock = Clock()
    est = CostEstimator(CostParams(), link_max_age_s=30.0, clock=clock)
    log: list[tuple[float, str, tuple[float, ...]]] = []
    for _ in range(60):
        step = rng.random()
        if step < 0.3:
            args: tuple[float, ...] = (rng.choice([1e6, 45e6, 200e6]), rng.uniform(0.001, 0.2), 1.0)
            log.append((clock.now, rng.choice(["prefill", "decode"]), args))
        elif step < 0.55:
            log.append((clock.now, "fill", (rng.randint(100, 9000), rng.randint(0, 9000), rng.uniform(0.01, 1))))
        else:
            clock.now += rng.choice([0.5, 5.0, 12.0])  # links age out past 30 s
        if log and log[-1][0] == clock.now and step < 0.55:
            _feed(est, log[-1])
        twin_clock = Clock()
        twin = CostEstimator(CostParams(), link_max_age_s=30.0, clock=twin_clock)
        for entry in log:
            twin_clock.now = entry[0]
            _feed(twin, entry)
        twin_clock.now = clock.now
        assert est.params() == twin.params()


def _feed(est: CostEstimator, entry: tuple[float, str, tuple[float, ...]]) -> None:
    _, kind, a = entry
    if kind == "fill":
        est.observe_prefill(
            new_tokens=int(a[0]), context_tokens=int(a[1]), pulled_tokens=0, seconds=a[2], block_size=16
        )
    else:
        est.observe_link(kind, a[0], a[1], a[2])
