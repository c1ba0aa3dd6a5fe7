#!/usr/bin/env python3
"""The goodput report: a sweep of conversations at once, from the JSON files ``gpu/load.py`` wrote (parts G1-G6).

usage: python gpu/goodput_report.py [load_G*.json ...] [--out results/gpu/goodput-report]

Per number of conversations at once and per mode: goodput (turns within both SLOs per second of the
wave) and attainment, TTFT p50 / p99 of first and of later turns, ITL p99 and TPOT p99; then the
ratios: turnkv adaptive against the best baseline (colocated, plain P/D, vLLM's multi-turn proxy policy)
and its ITL p99 against plain P/D's. Writes ``report.md`` and ``goodput.png`` (goodput, later turns'
TTFT p99 and ITL p99 against conversations, a line per mode) into OUT and prints the table rows. A file
from the simulator (``backend: sim``) is labelled as such: it says the scripts work, nothing about the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from turnkv.bench.report import md_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "gpu"
DEFAULT_OUT = RESULTS / "goodput-report"
BASELINES = ("colocated", "plain", "vllm-multiturn")
OURS = "adaptive"


def _f(x: Any, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def parse_slo(text: str) -> tuple[float, float]:
    """``2000:30`` -> (TTFT ms, TPOT ms)."""
    ttft, tpot = text.split(":")
    return float(ttft), float(tpot)


def slo_name(slo: tuple[float, float]) -> str:
    return f"ttft:{slo[0]:g} tpot:{slo[1]:g}"


def goodput_at(
    rows: Sequence[Sequence[Any]], wave: dict[str, Any], answer_tokens: int, slo: tuple[float, float]
) -> dict[str, Any]:
    """The wave's goodput at another SLO, from its request rows ([wave, start s, turn, TTFT ms,
    latency ms, status]; the answers are ``answer_tokens`` long, ``ignore_eos``): TPOT is (latency -
    TTFT) / (tokens - 1), as ``turnkv.bench.goodput`` computes it."""
    mine = [r for r in rows if r[0] == wave["wave"]]
    good = [
        r
        for r in mine
        if r[5] == 0
        and r[3] is not None
        and r[4] is not None
        and r[3] <= slo[0]
        and (r[4] - r[3]) / max(1, answer_tokens - 1) <= slo[1]
    ]
    later = [r for r in mine if r[2] > 1]
    wall = wave.get("wall_s") or 0.0
    return {
        "goodput_per_s": len(good) / wall if wall > 0 else None,
        "attainment": len(good) / len(mine) if mine else None,
        "later_attainment": sum(1 for r in good if r[2] > 1) / len(later) if later else None,
    }


def base(key: str) -> str:
    """The mode a key (``mode_keys``) names."""
    return key.split(" ")[0]


def mode_keys(results: Sequence[dict[str, Any]]) -> list[tuple[str, str, int, str]]:
    """(label, mode, round, key) per mode run: the key is the mode's name, with `` (label)`` where more than
    one input ran that mode (a later session's same-run anchor beside an earlier one's) and `` #round``
    where one input ran it in several rounds (``gpu/load.py --rounds``)."""
    runs = [(str(res.get("label")), m["mode"], int(m.get("round", 1))) for res in results for m in res.get("modes", [])]
    labels: dict[str, set[str]] = {}
    rounds: dict[tuple[str, str], int] = {}
    for label, mode, rnd in runs:
        labels.setdefault(mode, set()).add(label)
        rounds[(label, mode)] = max(rounds.get((label, mode), 0), rnd)
    out = []
    for label, mode, rnd in runs:
        key = (
            mode + (f" ({label})" if len(labels[mode]) > 1 else "") + (f" #{rnd}" if rounds[(label, mode)] > 1 else "")
        )
        out.append((label, mode, rnd, key))
    return out


def points(
    results: Sequence[dict[str, Any]], slo: tuple[float, float] | None = None
) -> dict[int, dict[str, dict[str, Any]]]:
    """conversations -> mode key (``mode_keys``) -> the wave's summary (the last wave of that count, if
    several), its ``goodput`` recomputed at ``slo`` where given."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    keys = {(label, mode, rnd): key for label, mode, rnd, key in mode_keys(results)}
    for res in results:
        answer = int(res.get("args", {}).get("answer_tokens", 128))
        for m in res.get("modes", []):
            rnd = int(m.get("round", 1))
            rows = res.get("requests", {}).get(m.get("requests_key", m["mode"]), [])
            key = keys[(str(res.get("label")), m["mode"], rnd)]
            for w in m.get("waves", []):
                if "goodput" in w:
                    if slo is not None:
                        w = {**w, "goodput": {**w["goodput"], **goodput_at(rows, w, answer, slo)}}
                    out.setdefault(int(w["conversations"]), {})[key] = {**w, "label": res.get("label"), "round": rnd}
    return dict(sorted(out.items()))


def _good(w: dict[str, Any] | None) -> float | None:
    return None if w is None else w["goodput"].get("goodput_per_s")


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def rows(pts: dict[int, dict[str, dict[str, Any]]], modes: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    head = ["conversations", "mode", "answered", "goodput /s (attainment; later turns)", "TTFT p50 / p99 turn 1 ms"]
    head += ["TTFT p50 / p99 later ms", "ITL p50 / p99 ms", "TPOT p99 ms"]
    body = []
    for n, by_mode in pts.items():
        for mode in modes:
            w = by_mode.get(mode)
            if w is None:
                continue
            g, t = w["goodput"], w["ttft_ms"]
            body.append(
                [
                    str(n),
                    mode,
                    f"{w['ok']}/{w['requests_expected']}" + (" (cut)" if w.get("cut") else ""),
                    f"{_f(g.get('goodput_per_s'), 2)} ({_f(100 * (g.get('attainment') or 0))}%; "
                    f"{_f(100 * (g.get('later_attainment') or 0))}%)",
                    f"{_f(t['turn 1']['p50'])} / {_f(t['turn 1']['p99'])}",
                    f"{_f(t['later turns']['p50'])} / {_f(t['later turns']['p99'])}",
                    f"{_f(w['itl_ms']['p50'], 1)} / {_f(w['itl_ms']['p99'], 1)}",
                    _f(g["tpot_ms"].get("p99"), 1),
                ]
            )
    return head, body


def _same_run(wave: dict[str, Any], mode: str, by_mode: dict[str, dict[str, Any]]) -> str | None:
    """The key of ``mode``'s wave from the same run (input file) and round as ``wave``, if that run had it."""
    for k, w in by_mode.items():
        if base(k) == mode and w.get("label") == wave.get("label") and w.get("round") == wave.get("round"):
            return k
    return None


def best_baseline(goodput: dict[str, float | None]) -> str | None:
    """The key in ``goodput`` of the baseline mode with the most goodput (None: no baseline ran)."""
    baselines = [k for k in goodput if base(k) in BASELINES and goodput[k] is not None]
    return max(baselines, key=lambda k: goodput[k] or 0.0) if baselines else None


def targets(
    pts: dict[int, dict[str, dict[str, Any]]], ours: Sequence[str] = (OURS,)
) -> tuple[list[str], list[list[str]]]:
    """Per count and per mode of ours: its goodput against the best baseline's (any run's), and its goodput
    and ITL p99 against plain P/D's, from the same run where that run had plain."""
    head = ["conversations", "mode", "best baseline", "/ best baseline (goodput)", "/ plain (goodput)"]
    head += ["/ plain (ITL p99)", "plain compared"]
    body = []
    for n, by_mode in pts.items():
        good = {k: _good(w) for k, w in by_mode.items()}
        best = best_baseline(good)
        for key in [k for k in by_mode if base(k) in ours]:
            w = by_mode[key]
            plain = _same_run(w, "plain", by_mode)
            pw = by_mode.get(plain) if plain else None
            body.append(
                [
                    str(n),
                    key,
                    f"{best} ({_f(good[best], 2)}/s)" if best else "-",
                    _ratio(_good(w), good[best] if best else None),
                    _ratio(_good(w), _good(pw)),
                    _ratio(w["itl_ms"]["p99"], pw["itl_ms"]["p99"] if pw else None),
                    plain or "-",
                ]
            )
    return head, body


# -- several rounds (gpu/load.py --rounds): the spread of each mode, and the ratios of its medians --------

Get = Callable[[dict[str, Any]], float | None]
# what the spread table and the plots read of a wave, and the digits the table shows
FIGURES: dict[str, tuple[Get, int]] = {
    "goodput": (_good, 2),
    "itl_p99": (lambda w: w["itl_ms"]["p99"], 1),
    "later_ttft_p50": (lambda w: w["ttft_ms"]["later turns"]["p50"], 0),
    "later_ttft_p99": (lambda w: w["ttft_ms"]["later turns"]["p99"], 0),
}
Values = dict[int, dict[str, dict[str, float | None]]]  # conversations -> mode -> figure -> value


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def by_base(by_mode: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A count's waves grouped by the mode they ran (every round, every part)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for k, w in by_mode.items():
        out.setdefault(base(k), []).append(w)
    return out


def _values(waves: Sequence[dict[str, Any]], get: Get) -> list[float]:
    return [v for v in (get(w) for w in waves) if v is not None]


def _spread(xs: Sequence[float], digits: int) -> str:
    if not xs:
        return "-"
    return f"{_f(_median(xs), digits)} ({_f(min(xs), digits)}-{_f(max(xs), digits)})"


def spread(pts: dict[int, dict[str, dict[str, Any]]]) -> tuple[list[str], list[list[str]]]:
    """Per count and mode, over its rounds: goodput, ITL p99 and later turns' TTFT p50 and p99."""
    head = ["conversations", "mode", "rounds", "goodput /s", "ITL p99 ms", "TTFT p50 later ms", "TTFT p99 later ms"]
    body = []
    for n, by_mode in pts.items():
        for mode, waves in by_base(by_mode).items():
            body.append(
                [str(n), mode, str(len(waves))] + [_spread(_values(waves, get), d) for get, d in FIGURES.values()]
            )
    return head, body


def spread_targets(
    pts: dict[int, dict[str, dict[str, Any]]], ours: Sequence[str] = (OURS,)
) -> tuple[list[str], list[list[str]]]:
    """Per count and mode of ours: its median goodput against the best baseline's median, and the median
    over rounds of its goodput and ITL p99 against plain P/D's of the same round (paired: the two ran a
    minute or two apart)."""
    head = ["conversations", "mode", "best baseline (median)", "/ best baseline (goodput, medians)"]
    head += ["/ plain, same round (goodput: median, range)", "/ plain, same round (ITL p99: median, range)"]
    body = []
    for n, by_mode in pts.items():
        groups = by_base(by_mode)
        med = {m: _median(_values(ws, _good)) for m, ws in groups.items()}
        best = best_baseline(med)
        for mode in [m for m in groups if m in ours]:
            pairs = []
            for w in groups[mode]:
                plain = _same_run(w, "plain", by_mode)
                if plain is not None:
                    pairs.append((w, by_mode[plain]))
            good = [a / b for a, b in ((_good(w), _good(p)) for w, p in pairs) if a is not None and b]
            itl = [w["itl_ms"]["p99"] / p["itl_ms"]["p99"] for w, p in pairs if p["itl_ms"]["p99"]]
            body.append(
                [
                    str(n),
                    mode,
                    f"{best} ({_f(med[best], 2)}/s)" if best else "-",
                    _ratio(med[mode], med[best] if best else None),
                    _spread(good, 2) + f" of {len(good)}",
                    _spread(itl, 2) + f" of {len(itl)}",
                ]
            )
    return head, body


def figures(pts: dict[int, dict[str, dict[str, Any]]]) -> Values:
    """Each wave's figures, by count and mode key."""
    return {
        n: {k: {f: get(w) for f, (get, _) in FIGURES.items()} for k, w in by_mode.items()} for n, by_mode in pts.items()
    }


def medians(pts: dict[int, dict[str, dict[str, Any]]]) -> Values:
    """Each count's median figures per mode, over its rounds."""
    return {
        n: {
            mode: {f: _median(_values(waves, get)) for f, (get, _) in FIGURES.items()}
            for mode, waves in by_base(by_mode).items()
        }
        for n, by_mode in pts.items()
    }


PANELS = (
    ("goodput, turns/s within the SLOs", "goodput"),
    ("TTFT p99 of later turns, ms", "later_ttft_p99"),
    ("ITL p99, ms", "itl_p99"),
)


def plot(values: Values, modes: Sequence[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (name, figure) in zip(axes, PANELS, strict=True):
        for mode in modes:
            xs = [n for n in values if mode in values[n]]
            ys = [values[n][mode][figure] for n in xs]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("conversations at once")
        ax.set_title(name, fontsize=9)
        if name.startswith(("TTFT", "ITL")):
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


INTRO = """# Goodput on one H200: a sweep of conversations at once

vLLM 0.26.0 + NIXL, gpu/make_model.py's Qwen3-8B-shaped model with dummy weights, P (:8100) and D (:8200, with the
turnkv plugin) sharing one H200 at 0.42 of its memory each, `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` on both, P's
prefix cache on. Per count of conversations at once (a closed loop: each conversation sends its next turn
after the answer and a think time) and per mode, one wave per round (`gpu/load.py`, `gpu/session.sh G1-G6`;
G4-G6 ran the modes in interleaved rounds, `#n` in a mode's name, each round with new prompts and the same
think times for every mode, and the tables "across rounds" give each mode's median and range): *plain*
is vLLM's P/D through a turnkv gateway without conversation ids, *vllm-multiturn* the gateway as vLLM's
multi-turn proxy policy (pulls the previous handle, unchecked), *adaptive* turnkv as shipped (from G4 on,
`shared_gpu: auto` finding the shared GPU), *adaptive-pull* the same without decode-local,
*adaptive-shared* the same told that P and D share the GPU
(the setting `shared_gpu`), *adaptive-first* with first turns on D allowed (`decode_local_first`),
*colocated* each turn straight to D (one engine prefilling and decoding; P idle). A mode that more than
one part ran is named with its part, `plain (G3_8-64)`; ratios to plain are to the same part's plain.
Goodput: turns within TTFT 2,000 ms and TPOT 30 ms per second of the wave's wall time (`vllm bench serve
--goodput ttft:2000 tpot:30`'s count). P and D share the GPU: a prefill on P
slows D's steps too (the GPU's compute is shared), which the disaggregated modes pay and colocated does
not, and colocated has the whole GPU's compute for one engine. Generated by `python gpu/goodput_report.py`.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--ours", action="append", help=f"a mode compared with the baselines (default: {OURS}); may repeat")
    ap.add_argument(
        "--slo",
        action="append",
        type=parse_slo,
        help="TTFT_MS:TPOT_MS, one table per SLO (default: vLLM's 2000:30, and 2000:60)",
    )
    a = ap.parse_args(argv)
    slos = a.slo or [(2000.0, 30.0), (2000.0, 60.0)]
    inputs = a.inputs or sorted(RESULTS.glob("load_G*.json"))
    results = [json.loads(p.read_text()) for p in inputs]
    a.out.mkdir(parents=True, exist_ok=True)
    modes = list(dict.fromkeys(key for _, _, _, key in mode_keys(results)))
    several = any(int(m.get("round", 1)) > 1 for res in results for m in res.get("modes", []))
    sim = any(res.get("backend") == "sim" for res in results)
    title = "goodput sweep" + (" (SIMULATOR: says the scripts work, nothing about the GPU)" if sim else ", one H200")
    parts = [INTRO]
    if sim:
        parts.append("\n**SIMULATOR RUN**: these numbers say the scripts work, nothing about the GPU.\n")
    for res in results:
        a_ = res.get("args", {})
        parts.append(
            f"\nPart {res.get('label')}: {a_.get('conversations')} conversations at once, {a_.get('turns')} turns, "
            f"{a_.get('system_tokens')}-token system prompt, {a_.get('user_tokens')}-token user turns, "
            f"{a_.get('answer_tokens')}-token answers, started {res.get('started')}, {res.get('seconds')} s; "
            f"skipped: {res.get('skipped') or 'none'}; error: {res.get('error') or 'none'}.\n"
        )
    for i, slo in enumerate(slos):
        pts = points(results, slo)
        head, body = rows(pts, modes)
        parts += [f"\n## Per count and mode, goodput at {slo_name(slo)}\n", md_table(head, body)]
        thead, tbody = targets(pts, a.ours or [OURS])
        parts += [f"\n## The ratios at {slo_name(slo)}\n", md_table(thead, tbody)]
        if several:
            shead, sbody = spread(pts)
            rhead, rbody = spread_targets(pts, a.ours or [OURS])
            parts += [f"\n## Across rounds at {slo_name(slo)}: median (min-max)\n", md_table(shead, sbody)]
            parts += [f"\n## The ratios across rounds at {slo_name(slo)}\n", md_table(rhead, rbody)]
            print(md_table(shead, sbody))
            print(md_table(rhead, rbody))
        if pts:
            name = "goodput.png" if i == 0 else f"goodput_tpot{slo[1]:g}.png"
            shown, names = (
                (medians(pts), list(dict.fromkeys(base(k) for k in modes))) if several else (figures(pts), modes)
            )
            plot(shown, names, f"{title}; goodput at {slo_name(slo)}" + (" (medians)" if several else ""), a.out / name)
            parts.append(f"\n![goodput, TTFT p99, ITL p99 against conversations]({name})\n")
        print(f"goodput at {slo_name(slo)}")
        print(md_table(head, body))
        print(md_table(thead, tbody))
    (a.out / "report.md").write_text("\n".join(parts))
    print(f"report: {a.out / 'report.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
