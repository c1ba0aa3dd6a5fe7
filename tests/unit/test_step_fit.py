"""gpu/fit_step_time.py: the fit finds the constants that made the samples, and reads samples out of
gpu/step_time.py's raw token times."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from turnkv.sim.costs import CostModel

GPU = Path(__file__).resolve().parents[2] / "gpu"


@pytest.fixture(scope="module")
def fit_mod() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fit_step_time", GPU / "fit_step_time.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fit_step_time"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_the_fit_finds_the_simulators_own_constants_again(fit_mod: ModuleType) -> None:
    m = CostModel()
    samples = []
    for b in (1, 8, 32, 64):
        for c in (1024, 8192):
            ctx = b * c
            samples.append(fit_mod.Sample(b, ctx, 0, 0, m.step_s(b, ctx) * 1e3))
            for p in (128, 512, 2048, 8000):
                for over in (0, c):
                    samples.append(fit_mod.Sample(b, ctx, p, over, m.step_s(b, ctx, [(p, over)]) * 1e3))
    f = fit_mod.fit(samples)
    assert f.free_tokens == m.free_tokens
    assert f.base_ms == pytest.approx(m.decode_base_s * 1e3, rel=1e-6)
    assert f.per_seq_us == pytest.approx(m.decode_per_seq_s * 1e6, rel=1e-5)
    assert f.per_ctx_ns == pytest.approx(m.decode_per_ctx_token_s * 1e9, rel=1e-6)
    assert f.per_token_us == pytest.approx(m.prefill_per_token_s * 1e6, rel=1e-6)
    assert f.attn_ns == pytest.approx(m.prefill_attn_s * 1e9, rel=1e-6)
    assert f.rms_ms == pytest.approx(0.0, abs=1e-6)
    flags = f.flags()
    assert flags[flags.index("--free-tokens") + 1] == str(m.free_tokens)


def test_too_few_samples_is_an_error(fit_mod: ModuleType) -> None:
    with pytest.raises(ValueError):
        fit_mod.fit([fit_mod.Sample(1, 100, 0, 0, 8.0)])


def test_samples_are_read_from_token_times(fit_mod: ModuleType) -> None:
    # two streams, a token every 10 ms; one 50 ms gap while a 512-token prompt was prefilled
    times = [i * 0.010 for i in range(200)]
    slow = [t if t < 1.5 else t + 0.040 for t in times]
    result = {
        "backend": "sim",
        "sim_time_scale": 1.0,
        "max_num_batched_tokens": 8192,
        "groups": [
            {
                "batch": 2,
                "context": 1000,
                "quiet": [0.2, 1.2],
                "injections": [
                    {"prefill": 512, "over": 0, "status": 200, "sent": 1.49, "ended": 1.55},
                    {"prefill": 512, "over": 0, "status": 500, "sent": 1.7, "ended": 1.8},
                ],
                "streams": [{"times": slow, "error": None}, {"times": slow, "error": None}],
            }
        ],
    }
    quiet, inj = fit_mod.samples_from(result)
    assert (quiet.batch, quiet.prefill, quiet.step_ms) == (2, 0, pytest.approx(10.0))
    assert quiet.context == 2 * (1000 + 21)  # tokens streamed up to the quiet second's start (t <= 0.2)
    assert (inj.prefill, inj.over, inj.step_ms) == (512, 0, pytest.approx(50.0))
