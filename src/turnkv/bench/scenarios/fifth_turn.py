"""The fifth-turn suite: TTFT of later turns under each way of serving a conversation.

Decides the matrix (a full policy x link x P-cache grid at a 16k-token history, and a history
sweep on one slow and one fast link with P's cache cold), runs every configuration at simulated
H200 speed (``--time-scale 1``: durations are not scaled, so TTFTs are real milliseconds, HTTP
hops and simulator CPU included), and compares TTFT_5 side by side: against plain P/D (turnkv
without session ids), against colocated serving with prefix caching, and against the best fixed
policy, with its targets (BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from turnkv.bench.records import ConfigResult
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment
from turnkv.bench.stats import fmt_ms, fmt_ratio, turn_stats
from turnkv.bench.workload import WorkloadSpec

LINKS = ("host", "h200-ipc", "100gbe", "rdma400", "nvlink")
POLICIES = ("adaptive", "always-pull", "never-pull", "decode-local")
FIXED = ("always-pull", "never-pull", "decode-local")
# adaptive with decode-local off: the pull-or-recompute choice alone (as when D is too busy to
# prefill), held against the better of always-pull and never-pull
PULL_ONLY = "adaptive-pull"
PULL_FIXED = ("always-pull", "never-pull")
# a simulated engine charges the transfers it reads at its own link; "h200-ipc" is the H200 host with
# CUDA IPC GET on: P pulls D's blocks at ~20 GB/s, D reads P's far faster (nvlink-like)
DECODE_LINK = {"h200-ipc": "nvlink"}
ENGINE = ("--vllm-compat", "0.33")  # 0.33 returns D's handle on the final SSE chunk
TURN = 5

WORKLOAD = WorkloadSpec(
    conversations=8,
    turns=TURN,
    user_tokens=150,
    answer_tokens=100,
    think_time_s=0.5,
    rate=1.0,
    concurrency=2,
    request_timeout_s=300.0,
    duration_s=900.0,
)


def _k(tokens: int) -> str:
    return f"{tokens // 1000}k"


def _shape(history: int, user: int) -> str:
    return _k(history) + ("" if user == WORKLOAD.user_tokens else f"-u{_k(user)}")


def _pd(
    history: int, link: str, cache: str, policy: str | None, conversations: int | None, user: int = WORKLOAD.user_tokens
) -> Bench:
    """``policy`` None is plain P/D: turnkv without session ids."""
    label = policy or "plain"
    name = f"{_shape(history, user)}-{link}-{cache}-{label}"
    wl = replace(
        WORKLOAD,
        system_tokens=history,
        user_tokens=user,
        session_header=policy is not None,
        conversations=conversations or WORKLOAD.conversations,
    )
    pull_only = policy == PULL_ONLY
    d_link = DECODE_LINK.get(link)
    dep = Deployment(
        "pd",
        engine_flags=(*ENGINE, "--link", link),
        prefill_flags=("--no-prefix-caching",) if cache == "cold" else (),
        decode_flags=("--link", d_link) if d_link else (),
        gateway_flags=("--policy", "adaptive" if pull_only or policy is None else policy),
        gateway_env=(("TURNKV_POLICY__PARAMS", '{"decode_local": false}'),)
        if pull_only
        # plain P/D: no session ids, and no conversation found from the messages either
        else (("TURNKV_CONVERSATION_FROM_HISTORY", "false"),)
        if policy is None
        else (),
    )
    what = (
        "plain P/D (turnkv, no session ids)"
        if policy is None
        else ("turnkv --policy adaptive, decode-local off" if pull_only else f"turnkv --policy {policy}")
    )
    links = f"{link} link" + (f" (D reads over {d_link})" if d_link else "")
    desc = f"1P1D, {links}, P prefix cache {'off' if cache == 'cold' else 'on'}, {what}"
    tags = {"history": history, "user": user, "link": link, "cache": cache, "policy": label}
    return Bench(dep, (ConfigPlan(name, f"{_shape(history, user)} {link} P-cache {cache}", desc, wl, tags),))


def _colocated(history: int, conversations: int | None, user: int = WORKLOAD.user_tokens) -> Bench:
    wl = replace(
        WORKLOAD,
        system_tokens=history,
        user_tokens=user,
        session_header=False,
        conversations=conversations or WORKLOAD.conversations,
    )
    tags = {"history": history, "user": user, "link": "-", "cache": "on", "policy": "colocated"}
    plan = ConfigPlan(
        f"{_shape(history, user)}-colocated",
        f"{_shape(history, user)} colocated",
        "one colocated engine with prefix caching, load sent to it directly",
        wl,
        tags,
    )
    return Bench(Deployment("colocated", engine_flags=ENGINE), (plan,))


def benches(conversations: int | None = None) -> list[Bench]:
    out: list[Bench] = [_colocated(16000, conversations)]
    for link in LINKS:
        for cache in ("cold", "warm") if link != "h200-ipc" else ("cold",):
            pols: tuple[str | None, ...] = (None, *POLICIES, *((PULL_ONLY,) if cache == "cold" else ()))
            out += [_pd(16000, link, cache, p, conversations) for p in pols]
    for history in (2000, 8000, 32000):
        out.append(_colocated(history, conversations))
        for link in ("host", "rdma400"):
            # the host link moves 0.45 GB/s: a 32k history is ~10 s per transfer, so fewer conversations
            n = conversations or (4 if (link, history) == ("host", 32000) else None)
            out += [_pd(history, link, "cold", p, n) for p in (None, *POLICIES)]
    # tool-output-sized user turns (2k tokens): ~90 ms of prefill on D, inside adaptive's stall budget
    out.append(_colocated(16000, conversations, user=2000))
    for link in ("host", "100gbe", "rdma400", "nvlink"):
        out += [_pd(16000, link, "cold", p, conversations, user=2000) for p in (None, *POLICIES)]
    return out


@dataclass
class _Cell:
    p50: float
    p90: float
    n: int
    errors: int
    actions: str


def _cell(c: ConfigResult) -> _Cell:
    s = turn_stats(c.requests, TURN)
    return _Cell(s.ttft_p50, s.ttft_p90, s.n, s.errors, s.actions_text())


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


Row = tuple[int, int, str, str]  # history, user tokens, link, P cache


def _turn5_cells(configs: Sequence[ConfigResult]) -> tuple[dict[Row, dict[str, _Cell]], dict[tuple[int, int], _Cell]]:
    """Turn-5 cells by row and policy, and colocated serving's by (history, user tokens); rows sorted."""
    rows: dict[Row, dict[str, _Cell]] = {}
    colocated: dict[tuple[int, int], _Cell] = {}
    for c in configs:
        t = c.meta.get("tags", {})
        if "history" not in t:
            continue
        user = t.get("user", WORKLOAD.user_tokens)
        if t["policy"] == "colocated":
            colocated[(t["history"], user)] = _cell(c)
        else:
            rows.setdefault((t["history"], user, t["link"], t["cache"]), {})[t["policy"]] = _cell(c)
    order = sorted(rows, key=lambda k: (k[1], k[0], LINKS.index(k[2]), k[3]))
    return {k: rows[k] for k in order}, colocated


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    """The comparison tables and the targets; plus plot groups (one panel per history/link/cache)."""
    cells, colocated = _turn5_cells(configs)
    groups: dict[str, list[str]] = {}
    for c in configs:
        t = c.meta.get("tags", {})
        if "history" in t and t["policy"] != "colocated":
            groups.setdefault(c.group, []).append(c.name)
    for g, names in groups.items():
        co_name = next(
            (
                c.name
                for c in configs
                if c.meta.get("tags", {}).get("policy") == "colocated" and c.group.split()[0] == g.split()[0]
            ),
            None,
        )
        if co_name:
            names.append(co_name)
    rows, checks, pull_rows = [], [], []
    nan = _Cell(math.nan, math.nan, 0, 0, "-")
    for (hist, user, link, cache), by_policy in cells.items():
        get = {p: by_policy.get(p, nan) for p in ("plain", *POLICIES, PULL_ONLY)}
        co = colocated.get((hist, user), nan)
        fixed = {p: get[p] for p in FIXED if not math.isnan(get[p].p50)}
        best = min(fixed, key=lambda p: fixed[p].p50) if fixed else "-"
        best_p50 = fixed[best].p50 if fixed else math.nan
        a = get["adaptive"]
        same = "yes" if fixed and a.actions == fixed[best].actions else "no"
        pairs = [f"{fmt_ms(get[p].p50)} / {fmt_ms(get[p].p90)}" for p in ("plain", *FIXED, "adaptive")]
        rows.append(
            [
                _k(hist),
                _k(user) if user >= 1000 else user,
                link,
                cache,
                fmt_ms(co.p50),
                *pairs,
                f"{best} {fmt_ms(best_p50)}",
                fmt_ratio(_ratio(a.p50, get["plain"].p50)),
                fmt_ratio(_ratio(a.p50, co.p50)),
                fmt_ratio(_ratio(a.p50, best_p50)),
                a.actions,
                same,
            ]
        )
        where = f"{_shape(hist, user)} {link} {cache}"
        checks.append(("adaptive <= 1.10x best fixed", where, _ratio(a.p50, best_p50), 1.10, same))
        ap = get[PULL_ONLY]
        pull_fixed = {p: get[p] for p in PULL_FIXED if not math.isnan(get[p].p50)}
        if not math.isnan(ap.p50) and pull_fixed:
            pbest = min(pull_fixed, key=lambda p: pull_fixed[p].p50)
            pull_rows.append(
                [
                    _k(hist),
                    link,
                    cache,
                    *(f"{fmt_ms(get[p].p50)} / {fmt_ms(get[p].p90)}" for p in (*PULL_FIXED, PULL_ONLY)),
                    f"{pbest} {fmt_ms(pull_fixed[pbest].p50)}",
                    fmt_ratio(_ratio(ap.p50, pull_fixed[pbest].p50)),
                    ap.actions,
                ]
            )
            checks.append(
                (
                    f"{PULL_ONLY} <= 1.10x better of pull/recompute",
                    where,
                    _ratio(ap.p50, pull_fixed[pbest].p50),
                    1.10,
                    "yes" if ap.actions == pull_fixed[pbest].actions else "no",
                )
            )
        if hist == 16000 and cache == "cold" and link in ("rdma400", "nvlink"):
            checks.append(("adaptive <= 0.5x plain P/D", where, _ratio(a.p50, get["plain"].p50), 0.5, ""))
            checks.append(("adaptive <= 1.15x colocated", where, _ratio(a.p50, co.p50), 1.15, ""))
    errors = [(c.name, sum(1 for r in c.requests if not r.ok)) for c in configs]
    out = [
        f"## TTFT_{TURN} (ms, p50 / p90) side by side",
        "",
        "Ratios use p50. *best fixed* is the fastest of always-pull, never-pull and decode-local in the same row. "
        "*actions* are turnkv's decisions on turn 5 under `adaptive` (from x-turnkv-action).",
        "",
        md_table(
            [
                "history",
                "user turn",
                "link",
                "P cache",
                "colocated p50",
                "plain P/D",
                "always-pull",
                "never-pull",
                "decode-local",
                "adaptive",
                "best fixed",
                "adaptive / plain",
                "adaptive / colocated",
                "adaptive / best fixed",
                "adaptive actions",
                "same actions as best fixed",
            ],
            rows,
        ),
        "",
        f"## Pull or recompute: `{PULL_ONLY}` (adaptive with decode-local off)",
        "",
        "The choice the policy faces when D should not prefill the turn itself (busy, or a long user turn), "
        "held against the better of the two fixed policies.",
        "",
        md_table(
            [
                "history",
                "link",
                "P cache",
                "always-pull",
                "never-pull",
                PULL_ONLY,
                "better fixed",
                f"{PULL_ONLY} / better fixed",
                f"{PULL_ONLY} actions",
            ],
            pull_rows,
        ),
        "",
        "## Targets",
        "",
        "Where adaptive took the same turn-5 actions as the best fixed policy, the two ran the same path and "
        "their ratio measures run-to-run noise (8 samples each), not the policy.",
        "",
        md_table(
            ["target", "where", "measured", "limit", "met", "same actions as best fixed"],
            [
                [
                    name,
                    where,
                    fmt_ratio(x),
                    f"{lim:.2f}x",
                    "-" if math.isnan(x) else ("met" if x <= lim else "MISSED"),
                    same,
                ]
                for name, where, x, lim, same in checks
            ],
        ),
        "",
        "## R5/R1 (TTFT_5 p50 / TTFT_1 p50) per configuration",
        "",
        md_table(
            ["config", "TTFT_1 p50", "TTFT_5 p50", "R5/R1", "errors"],
            [
                [
                    c.name,
                    fmt_ms(turn_stats(c.requests, 1).ttft_p50),
                    fmt_ms(turn_stats(c.requests, TURN).ttft_p50),
                    fmt_ratio(_ratio(turn_stats(c.requests, TURN).ttft_p50, turn_stats(c.requests, 1).ttft_p50)),
                    e,
                ]
                for c, (_, e) in zip(configs, errors, strict=True)
            ],
        ),
        "",
    ]
    return "\n".join(out), groups


def plot_turn5(configs: Sequence[ConfigResult], path: Path) -> None:
    """TTFT_5 p50 (bar) and p90 (tick) of every configuration, one cluster per history/link/P-cache row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("colocated", "plain", *FIXED, "adaptive", PULL_ONLY)
    rows, colocated = _turn5_cells(configs)
    keys = list(rows)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.75 * len(keys)), 4.2))
    width = 0.8 / len(order)
    for j, pol in enumerate(order):
        xs, p50, p90 = [], [], []
        for i, k in enumerate(keys):
            cell = colocated.get(k[:2]) if pol == "colocated" else rows[k].get(pol)
            if cell is None or math.isnan(cell.p50):
                continue
            xs.append(i + (j - (len(order) - 1) / 2) * width)
            p50.append(cell.p50)
            p90.append(cell.p90)
        ax.bar(xs, p50, width, color=f"C{j}", label=pol)
        ax.plot(xs, p90, "_", color="k", ms=4)
    labels = [f"{_shape(h, u)}\n{link}\n{cache}" for h, u, link, cache in keys]
    ax.set_xticks(range(len(keys)), labels, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel(f"TTFT_{TURN} ms (bar p50, tick p90)")
    ax.set_title(f"TTFT of turn {TURN} by history, link and P cache (simulated H200, time-scale 1)", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=len(order))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
