"""The doctor's profile as the gateway loads it: its figures become the cost model's priors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnkv.config import ConfigError, Settings, load_settings
from turnkv.gateway.app import cost_priors
from turnkv.profile import ComputeFigures, LinkFigures, Profile, load_profile, priors_view, write_profile

P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"


def profile(**over: object) -> Profile:
    base: dict[str, object] = {
        "measured_at": "2026-12-03T12:00:00+00:00",
        "prefill": P,
        "decode": D,
        "pull": LinkFigures(fixed_ms=5.0, gbps=45.0, samples=3),
        "push": LinkFigures(fixed_ms=2.0, gbps=300.0, samples=3),
        "compute": ComputeFigures(hop_ms=4.0, us_per_token=30.0, attn_ns=1.5, samples=3),
        "kv_bytes_per_token": 57344,
        "block_size": 16,
    }
    return Profile.model_validate({**base, **over})


def test_the_gateway_takes_the_measured_figures_as_priors(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_profile(path, profile())
    defaults = cost_priors(Settings(prefill=[P], decode=[D]))
    p = cost_priors(Settings(prefill=[P], decode=[D], profile=str(path)))
    assert p.link() == pytest.approx((0.005, 45e9))
    assert p.link(push=True) == pytest.approx((0.002, 300e9))
    assert (p.hop_s, p.prefill_per_token_s, p.prefill_attn_s) == pytest.approx((0.004, 30e-6, 1.5e-9))
    assert p.kv_bytes_per_token == 57344
    # what it did not measure stays the settings'
    assert (p.prefill_floor_s, p.recompute_threshold) == (defaults.prefill_floor_s, defaults.recompute_threshold)


def test_a_profile_without_p_to_d_takes_d_to_p_for_both(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_profile(path, profile(push=None))
    p = cost_priors(Settings(prefill=[P], decode=[D], profile=str(path), costs={"push_link_gbps": 100.0}))
    assert p.link(push=True) == p.link() == pytest.approx((0.005, 45e9))


def test_a_doctor_report_is_a_profile_too(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"format": 1, "findings": [], "profile": profile().model_dump()}))
    assert load_profile(path) == profile()


@pytest.mark.parametrize(
    ("content", "says"),
    [(None, "No such file"), ("{", "not JSON"), ('{"format": 1}', "not a turnkv doctor profile")],
)
def test_an_unusable_profile_stops_the_gateway_at_start(tmp_path: Path, content: str | None, says: str) -> None:
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=says):
        load_settings(prefill=[P], decode=[D], profile=str(path))


def test_ready_says_where_the_priors_came_from(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_profile(path, profile())
    s = Settings(prefill=[P], decode=[D], profile=str(path))
    view = priors_view(cost_priors(s), s.measured, s.profile)
    assert view["source"] == "profile"
    assert view["profile"]["file"] == str(path) and view["profile"]["measured_at"] == "2026-12-03T12:00:00+00:00"
    assert view["pull"] == {"fixed_ms": 5.0, "gbps": 45.0}
    plain = Settings(prefill=[P], decode=[D])
    assert priors_view(cost_priors(plain), plain.measured, None)["source"] == "settings"
