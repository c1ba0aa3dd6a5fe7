#!/usr/bin/env python3
"""Fits the simulator's step model to what gpu/step_time.py measured on real vLLM.

The model (``src/turnkv/sim/costs.py``): a step of ``B`` decode streams reading ``ctx`` tokens of KV in
all, with a prefill chunk of ``P`` tokens over ``over`` tokens of cached context, lasts

    base + per_seq * B + per_ctx * ctx + per_token * max(0, B + P - free) + attn * P * (over + P/2)

Samples: each group's quiet second (the median token gap: ``P = 0``), and each injection whose prefill
fits in one step (``B + P <= max_num_batched_tokens``) with the longest token gap inside its window
(median over the streams). ``ctx`` is the streams' context when the sample was taken (their prompt
plus what they had generated). ``free`` is chosen on a grid, the rest by least squares.

    .venv/bin/python gpu/fit_step_time.py OUT/step_time.json [--json fit.json]

Runs here with turnkv installed (its least squares: ``turnkv.reuse.lstsq``). Prints the constants, the
``turnkv sim`` flags that set them, and each sample's residual.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from turnkv.reuse.lstsq import lstsq

FREE_GRID = (0, 16, 32, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class Sample:
    batch: int
    context: int  # tokens of KV the decode batch reads, all streams together
    prefill: int  # tokens of the prefill chunk in the step (0: a decode-only step)
    over: int  # tokens of cached context before the chunk
    step_ms: float


@dataclass(frozen=True)
class Fit:
    base_ms: float
    per_seq_us: float
    per_ctx_ns: float
    per_token_us: float
    free_tokens: int
    attn_ns: float
    rms_ms: float
    samples: int

    def flags(self) -> list[str]:
        """The ``turnkv sim`` flags that give the simulator these constants."""
        return [
            "--decode-itl-ms",
            f"{self.base_ms:.3f}",
            "--decode-per-seq-us",
            f"{self.per_seq_us:.2f}",
            "--decode-ctx-ns",
            f"{self.per_ctx_ns:.2f}",
            "--prefill-us-per-token",
            f"{self.per_token_us:.2f}",
            "--free-tokens",
            str(self.free_tokens),
            "--prefill-attn-ns",
            f"{self.attn_ns:.3f}",
        ]


def features(s: Sample, free: int) -> list[float]:
    return [
        1.0,
        float(s.batch),
        float(s.context),
        float(max(0, s.batch + s.prefill - free)),
        s.prefill * (s.over + s.prefill / 2),
    ]


def fit(samples: list[Sample]) -> Fit:
    """The constants that minimise the squared error over ``samples``, ``free`` from ``FREE_GRID``."""
    if len(samples) < 5:
        raise ValueError(f"{len(samples)} samples: too few to fit 6 constants")
    best: tuple[float, int, list[float]] | None = None
    ys = [s.step_ms / 1e3 for s in samples]
    for free in FREE_GRID:
        xs = [features(s, free) for s in samples]
        c = lstsq([(x, y, 1.0) for x, y in zip(xs, ys, strict=True)], scale_columns=True)
        if c is None:
            continue
        sse = sum((sum(a * b for a, b in zip(x, c, strict=True)) - y) ** 2 for x, y in zip(xs, ys, strict=True))
        if best is None or sse < best[0] - 1e-15:
            best = (sse, free, c)
    if best is None:
        raise ValueError("the samples do not determine the constants")
    sse, free, c = best
    return Fit(
        base_ms=c[0] * 1e3,
        per_seq_us=c[1] * 1e6,
        per_ctx_ns=c[2] * 1e9,
        per_token_us=c[3] * 1e6,
        free_tokens=free,
        attn_ns=c[4] * 1e9,
        rms_ms=math.sqrt(sse / len(samples)) * 1e3,
        samples=len(samples),
    )


def predict_ms(f: Fit, s: Sample) -> float:
    return (
        f.base_ms
        + f.per_seq_us * s.batch / 1e3
        + f.per_ctx_ns * s.context / 1e6
        + f.per_token_us * max(0, s.batch + s.prefill - f.free_tokens) / 1e3
        + f.attn_ns * s.prefill * (s.over + s.prefill / 2) / 1e6
    )


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def samples_from(result: dict[str, Any]) -> list[Sample]:
    """The samples in a step_time.json, in the engine's own time (the simulator's time scale undone)."""
    scale = result.get("sim_time_scale") or 1.0
    budget = int(result.get("max_num_batched_tokens", 8192))
    out: list[Sample] = []
    for g in result.get("groups", []):
        if g.get("error"):
            continue
        streams = [s["times"] for s in g.get("streams", []) if s.get("times")]
        b, c = int(g["batch"]), int(g["context"])
        if len(streams) < b:
            continue

        def ctx_at(t: float, streams: list[list[float]] = streams, c: int = c) -> int:
            return sum(c + sum(1 for x in ts if x <= t) for ts in streams)

        def gaps(lo: float, hi: float, streams: list[list[float]] = streams) -> list[list[float]]:
            return [[(y - x) * 1e3 for x, y in zip(ts, ts[1:], strict=False) if lo <= y <= hi] for ts in streams]

        q = g.get("quiet")
        if q:
            quiet = _median([x for gs in gaps(q[0], q[1]) for x in gs])
            if quiet is not None:
                out.append(Sample(b, ctx_at(q[0]), 0, 0, quiet / scale))
        for inj in g.get("injections", []):
            if inj.get("status") != 200 or b + int(inj["prefill"]) > budget:
                continue
            longest = [max(gs) for gs in gaps(inj["sent"], inj["ended"] + 0.05) if gs]
            step = _median(longest)
            if step is not None:
                out.append(Sample(b, ctx_at(inj["sent"]), int(inj["prefill"]), int(inj["over"]), step / scale))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="step_time.json from gpu/step_time.py")
    ap.add_argument("--json", type=Path, default=None, help="write the fit and the samples here")
    a = ap.parse_args(argv)
    res = json.loads(a.result.read_text())
    samples = samples_from(res)
    try:
        f = fit(samples)
    except ValueError as exc:
        print(f"fit_step_time: {exc}", file=sys.stderr)
        return 1
    print(f"backend {res.get('backend')}, {f.samples} samples, rms {f.rms_ms:.2f} ms")
    for k, v in asdict(f).items():
        print(f"  {k:14} {v:.4g}" if isinstance(v, float) else f"  {k:14} {v}")
    print("turnkv sim " + " ".join(f.flags()))
    print(f"{'B':>4} {'ctx':>8} {'P':>6} {'over':>6} {'measured':>9} {'model':>9}")
    for s in samples:
        print(f"{s.batch:>4} {s.context:>8} {s.prefill:>6} {s.over:>6} {s.step_ms:>9.2f} {predict_ms(f, s):>9.2f}")
    if a.json:
        a.json.write_text(
            json.dumps({"fit": asdict(f), "flags": f.flags(), "samples": [asdict(s) for s in samples]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
