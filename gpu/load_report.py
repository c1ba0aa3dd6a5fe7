#!/usr/bin/env python3
"""The load report: many conversations at once, from the JSON files gpu/load.py wrote (run anywhere, not on the GPU).

usage: python gpu/load_report.py [load_*.json ...] [--out results/gpu/load-report]

Without inputs it reads ``results/gpu/load_*.json`` (where gpu/ writes them). Writes into OUT:
``report.md`` (per part: turns answered, hung and failed, TTFT p50/p99 for turn 1 and later turns, ITL,
D's memory and the gateway's pins, releases, decisions, the gateway log's turn events), and per part
``timeline_<label>.png`` (D's KV usage, the pinned share of D's KV and the pin budget, P's KV usage,
D's running and waiting requests against time, a panel per mode, both waves on one axis) and
``ttft_<label>.png`` (each request's TTFT against when it was sent; misses marked). Prints the rows
for BENCHMARKS.md on stdout. A file from the simulator (``backend: sim``) is labelled as such
everywhere: its numbers say the scripts work, nothing about the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from turnkv.bench.report import md_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "gpu"
DEFAULT_OUT = RESULTS / "load-report"
STATUS = {0: "ok", 1: "deadline", 2: "failed"}


def _f(x: Any, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _pair(p: dict[str, Any] | None) -> str:
    p = p or {}
    return f"{_f(p.get('p50'))} / {_f(p.get('p99'))}"


def _peak(tl: dict[str, list[Any]], key: str, w: dict[str, Any] | None = None) -> float | None:
    """The largest value of a series (within a wave's span where given)."""
    ts, vals = tl.get("t", []), tl.get(key, [])
    sel = [
        v
        for t, v in zip(ts, vals, strict=False)
        if v is not None and (w is None or w.get("start_s", 0) <= t <= w.get("end_s", math.inf))
    ]
    return max(sel) if sel else None


def _last(tl: dict[str, list[Any]], key: str) -> float | None:
    vals = [v for v in tl.get(key, []) if v is not None]
    return vals[-1] if vals else None


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.1f}"


def _share(x: float | None, cap: float | None) -> str:
    return "-" if x is None or not cap else f"{100 * x / cap:.0f}%"


def _top(counts: dict[str, Any] | None, n: int = 4) -> str:
    items = sorted((counts or {}).items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {int(v)}" for k, v in items[:n]) + (" ..." if len(items) > n else "") or "-"


def _family(counters: dict[str, Any] | None, fam: str, label: str) -> dict[str, float]:
    """One counter family's values by one label (``why=budget`` -> ``budget``)."""
    out: dict[str, float] = {}
    for key, v in ((counters or {}).get(fam) or {}).items():
        labels = dict(kv.split("=", 1) for kv in key.split(",") if "=" in kv)
        name = labels.get(label, key or "-")
        out[name] = out.get(name, 0.0) + v
    return out


def waves(res: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(m, w) for m in res.get("modes", []) for w in m.get("waves", []) if "ttft_ms" in w]


def part_title(res: dict[str, Any]) -> str:
    a = res.get("args", {})
    sim = " — SIMULATOR, not GPU numbers" if res.get("backend") == "sim" else ""
    return (
        f"{res.get('label')}: {a.get('conversations')} conversations x {a.get('turns')} turns, P's prefix "
        f"cache {a.get('p_cache')}{sim}"
    )


def part_markdown(res: dict[str, Any], images: dict[str, str]) -> str:
    a = res.get("args", {})
    out = [f"## {part_title(res)}", ""]
    engines = f"{res.get('kv_extra') or 'vLLM defaults'} in kv_connector_extra_config, " + (
        ", ".join(a.get("ucx") or []) or "no UCX settings"
    )
    out.append(
        f"Workload per wave: {a.get('conversations')} conversations started at once, each its own "
        f"{a.get('system_tokens')}-token system prompt, {a.get('turns')} turns of {a.get('user_tokens')} "
        f"new tokens and {a.get('answer_tokens')}-token answers (ignore_eos), think time exponential with "
        f"mean {a.get('think_time_s')} s; wave 2 started as wave 1 ended; client deadline "
        f"{a.get('request_timeout_s')} s per request. Engines: {engines}; engine start "
        f"{res.get('engine_start_s')} s. Backend: {res.get('backend')}; {res.get('seconds')} s in all."
    )
    if res.get("skipped"):
        out += [
            "",
            "Not run (time budget): "
            + "; ".join(f"{s['mode']} (needed ~{s['needed_s']} s, {s['left_s']} s left)" for s in res["skipped"]),
        ]
    if res.get("error"):
        out += ["", f"**The script stopped with an error:** `{res['error'][-400:]}`"]
    for f in res.get("engine_failures", []):
        out += ["", f"Engines did not start with `{f.get('kv_extra')}`: `{str(f.get('error'))[-300:]}`"]
    rows = []
    for m, w in waves(res):
        t = w["ttft_ms"]
        rows.append(
            [
                m["mode"],
                w["wave"],
                f"{w['answered']}/{w['requests_expected']}",
                w["hung"],
                w["failed"],
                w["not_sent"] + w.get("in_flight_at_cut", 0),
                "yes" if w.get("cut") else "",
                _pair(t.get("turn 1")),
                _pair(t.get("later turns")),
                _f((t.get("later turns") or {}).get("max")),
                _pair(w.get("itl_ms")),
                _f(w.get("wall_s"), 1),
            ]
        )
    out += [
        "",
        "### Turns",
        "",
        "Answered of expected; hung = the client's deadline passed; failed = an error "
        "answer; not answered = turns a conversation did not reach after a failed turn, or cut at the time budget "
        "(sent or not). "
        "Times in ms, client-side.",
        "",
        md_table(
            [
                "mode",
                "wave",
                "answered",
                "hung",
                "failed",
                "not answered",
                "cut",
                "TTFT p50 / p99 turn 1",
                "TTFT p50 / p99 later turns",
                "TTFT max later",
                "ITL p50 / p99",
                "wave s",
            ],
            rows,
        ),
    ]
    turns = sorted({int(k) for _, w in waves(res) for k in w.get("ttft_ms_by_turn", {})})
    rows = [[m["mode"], w["wave"], *[_pair(w["ttft_ms_by_turn"].get(str(k))) for k in turns]] for m, w in waves(res)]
    out += ["", "### TTFT p50 / p99 by turn (ms)", "", md_table(["mode", "wave", *[f"turn {k}" for k in turns]], rows)]
    rows = []
    for m, w in waves(res):
        tl = m.get("timeline", {})
        cap = _peak(tl, "capacity")
        gc = w.get("gateway_counters")
        rows.append(
            [
                m["mode"],
                w["wave"],
                _f(100 * (_peak(tl, "d_kv", w) or 0)) + "%",
                _f(_peak(tl, "d_run", w)),
                _f(_peak(tl, "d_wait", w)),
                f"{_gb(_peak(tl, 'pinned', w))} ({_share(_peak(tl, 'pinned', w), cap)})" if cap else "-",
                f"{_gb(_peak(tl, 'budget', w))} ({_share(_peak(tl, 'budget', w), cap)})" if cap else "-",
                _top(_family(gc, "turnkv_handle_releases_total", "why")),
                _top(_family(gc, "turnkv_first_token_deadline_misses_total", "leg")),
            ]
        )
    out += [
        "",
        "### Decode memory",
        "",
        "Peaks within the wave, from D's /metrics read every "
        f"{a.get('sample_s')} s (`vllm:kv_cache_usage_perc`, running, waiting) and the gateway's "
        "(`turnkv_pinned_kv_bytes`, `turnkv_pinned_kv_budget_bytes`, as GB and as a share of D's KV capacity "
        "`turnkv_pinned_kv_capacity_bytes`); releases and first-token deadline misses are the gateway's "
        "counters over the wave. The gateway refreshes its pinned gauges at each janitor pass "
        "(`decode_memory.janitor_interval_s`, 5 s), D its usage at every scheduler step.",
        "",
        md_table(
            [
                "mode",
                "wave",
                "D KV peak",
                "D running peak",
                "D waiting peak",
                "pinned peak GB",
                "budget GB",
                "releases (why)",
                "deadline misses",
            ],
            rows,
        ),
    ]
    rows = []
    for m in res.get("modes", []):
        rest = m.get("gateway_at_rest") or {}
        rows.append(
            [
                m["mode"],
                _f(100 * ((m.get("at_start") or {}).get("d_kv") or 0)) + "%",
                f"{_gb(rest.get('pinned'))} in {_f(rest.get('handles'))} handles" if rest else "-",
                _f(100 * ((m.get("after_stop") or {}).get("d_kv") or 0)) + "%",
                "yes" if (m.get("d_restarted_before") or {}).get("restarted") else "",
                _f(m.get("seconds"), 1),
            ]
        )
    out += [
        "",
        "### At rest",
        "",
        "D's KV usage before the mode, the pins left when both waves had ended (before "
        "the gateway stopped), and D's KV usage after the gateway stopped (its shutdown releases its pins).",
        "",
        md_table(
            [
                "mode",
                "D KV before",
                "pinned after the waves",
                "D KV after the gateway stopped",
                "D restarted before (leak)",
                "mode s",
            ],
            rows,
        ),
    ]

    def decided(w: dict[str, Any], group: str) -> dict[str, Any]:
        return {k.split(": ", 1)[1]: v for k, v in w.get("decisions", {}).items() if k.startswith(group + ": ")}

    rows = [
        [
            m["mode"],
            w["wave"],
            _top(decided(w, "turn 1"), 2),
            _top(decided(w, "later turns"), 4),
            _top(_family(w.get("gateway_counters"), "turnkv_handle_captures_total", "result"), 4),
            _top(w.get("errors"), 3),
        ]
        for m, w in waves(res)
    ]
    out += [
        "",
        "### turnkv's decisions",
        "",
        "From the response headers (outcome/action/reason) and the gateway's capture counter.",
        "",
        md_table(["mode", "wave", "turn 1", "later turns", "captures", "errors"], rows),
    ]
    rows = []
    for m in res.get("modes", []):
        g = m.get("gateway_log")
        if g:
            rows.append(
                [
                    m["mode"],
                    g.get("turn_events"),
                    _top(g.get("outcome")),
                    _top(g.get("reason")),
                    _top(g.get("capture")),
                    _top(g.get("warnings"), 6),
                ]
            )
    if rows:
        out += [
            "",
            "### The gateway's log",
            "",
            "Its `turn` events over both waves, and its other events at warning level or above.",
            "",
            md_table(["mode", "turns", "outcome", "reason", "capture", "warnings"], rows),
        ]
    for name, rel in images.items():
        out += ["", f"![{name}]({rel})"]
    return "\n".join(out) + "\n"


def plot_timeline(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in res.get("modes", []) if m.get("timeline", {}).get("t")]
    fig, axes = plt.subplots(max(len(modes), 1), 1, figsize=(10, 2.7 * max(len(modes), 1)), squeeze=False)
    for ax, m in zip(axes[:, 0], modes, strict=False):
        tl = m["timeline"]
        t = tl["t"]
        cap = _peak(tl, "capacity")

        def pct(key: str, tl: dict[str, list[Any]] = tl, cap: float | None = cap) -> list[float]:
            vals = tl.get(key, [])
            if key in ("pinned", "budget"):  # a budget of 0: the gateway has not read D's capacity yet
                return [
                    math.nan if v is None or not cap or (key == "budget" and not v) else 100 * v / cap for v in vals
                ]
            return [math.nan if v is None else 100 * v for v in vals]

        for w in m.get("waves", []):
            if "start_s" in w:
                ax.axvspan(w["start_s"], w["end_s"], color="C0" if w["wave"] == 1 else "C1", alpha=0.07)
                ax.text(w["start_s"], 101, f" wave {w['wave']}", fontsize=7, va="bottom")
        ax.plot(t, pct("d_kv"), color="C0", lw=1.3, label="D KV usage %")
        if "p_kv" in tl:
            ax.plot(t, pct("p_kv"), color="C7", lw=0.8, ls=":", label="P KV usage %")
        if cap:
            ax.plot(t, pct("pinned"), color="C3", lw=1.3, label="pinned, % of D's KV")
            ax.plot(t, pct("budget"), color="C3", lw=0.8, ls="--", label="pin budget")
        ax.set_ylim(0, 110)
        ax.set_ylabel("% of KV")
        r = ax.twinx()
        r.plot(t, tl.get("d_run", []), color="C2", lw=0.7, label="D running")
        r.plot(t, tl.get("d_wait", []), color="C1", lw=0.7, label="D waiting")
        r.set_ylabel("requests")
        hung = sum(w.get("hung", 0) for w in m.get("waves", []))
        failed = sum(w.get("failed", 0) for w in m.get("waves", []))
        ax.set_title(f"{m['mode']}: {hung} hung, {failed} failed", fontsize=9)
        handles = ax.get_legend_handles_labels()
        rh = r.get_legend_handles_labels()
        ax.legend(handles[0] + rh[0], handles[1] + rh[1], fontsize=6, loc="upper right", ncol=3)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the mode started")
    fig.suptitle(part_title(res), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_ttft(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs: dict[str, list[list[Any]]] = res.get("requests") or {}
    modes = [m["mode"] for m in res.get("modes", []) if reqs.get(m["mode"])]
    n = max(len(modes), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.4), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes, strict=False):
        rows = reqs[mode]  # [wave, start_s, turn, ttft_ms, latency_ms, status]
        for first, color, label in ((True, "C0", "turn 1"), (False, "C1", "later turns")):
            pts = [(r[1], r[3]) for r in rows if r[5] == 0 and r[3] is not None and (r[2] == 1) == first]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=5, color=color, label=label)
        bad = [(r[1], r[4] or r[3] or 1.0, r[5]) for r in rows if r[5] != 0]
        for status, marker in ((1, "x"), (2, "v")):
            pts = [b for b in bad if b[2] == status]
            if pts:
                ax.scatter(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    s=18,
                    marker=marker,
                    color="C3",
                    label=f"{STATUS[status]} ({len(pts)})",
                )
        ax.set_yscale("log")
        ax.set_title(mode, fontsize=9)
        ax.set_xlabel("sent, s since the mode started")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    axes[0, 0].set_ylabel("TTFT ms (misses: when the client gave up)")
    fig.suptitle(part_title(res), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def benchmark_rows(results: Sequence[dict[str, Any]]) -> str:
    rows = []
    for res in results:
        a = res.get("args", {})
        part = f"{a.get('conversations')} conv x {a.get('turns')} turns, P cache {a.get('p_cache')}" + (
            " (SIMULATOR)" if res.get("backend") == "sim" else ""
        )
        for m, w in waves(res):
            tl = m.get("timeline", {})
            cap = _peak(tl, "capacity")
            t = w["ttft_ms"]
            rows.append(
                [
                    part,
                    m["mode"],
                    w["wave"],
                    f"{w['answered']}/{w['requests_expected']}",
                    f"{w['hung']} / {w['failed']}",
                    _pair(t.get("turn 1")),
                    _pair(t.get("later turns")),
                    _pair(w.get("itl_ms")),
                    _f(100 * (_peak(tl, "d_kv", w) or 0)) + "%",
                    _share(_peak(tl, "pinned", w), cap) if cap else "-",
                ]
            )
    return md_table(
        [
            "load (one H200, P and D sharing it)",
            "mode",
            "wave",
            "answered",
            "hung / failed",
            "TTFT p50 / p99 turn 1 ms",
            "TTFT p50 / p99 later ms",
            "ITL p50 / p99 ms",
            "D KV peak",
            "pinned peak (of D's KV)",
        ],
        rows,
    )


INTRO = """# Load on one H200: many conversations, two waves

vLLM 0.26.0 + NIXL, gpu/make_model.py's Qwen3-8B-shaped model with dummy weights, P (:8100) and D (:8200, with the
turnkv plugin) sharing one H200 at 0.42 of its memory each, `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` on both.
Per part and mode, two waves of the same workload back to back (`gpu/load.py`, `gpu/session.sh L1-L4`,
gpu/README.md): *plain* is vLLM's P/D through a turnkv gateway without conversation ids,
*adaptive* is turnkv's adaptive policy, *adaptive-pull* the same without decode-local, *colocated* sends
each turn straight to D. Each request has a client deadline; a miss counts as hung. Five turns did
not fit one 10-minute step: 32 conversations ran 4 turns, 64 ran 3. Generated by `python gpu/load_report.py`
from the `load_*.json` files gpu/load.py wrote.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    inputs = a.inputs or sorted(RESULTS.glob("load_*.json"))
    results = [json.loads(p.read_text()) for p in inputs]
    a.out.mkdir(parents=True, exist_ok=True)
    parts = [INTRO]
    if not results:
        parts.append("\nNo results yet: the device calls L1-L3 have not been run.\n")
    for res in results:
        label = str(res.get("label"))
        images = {}
        for kind, plot in (("timeline", plot_timeline), ("ttft", plot_ttft)):
            name = f"{kind}_{label}.png"
            plot(res, a.out / name)
            images[f"{kind} {label}"] = name
        parts.append(part_markdown(res, images))
    (a.out / "report.md").write_text("\n".join(parts))
    if results:
        print(benchmark_rows(results))
    print(f"report: {a.out / 'report.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
