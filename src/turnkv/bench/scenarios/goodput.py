"""The goodput suite: load sweeps of multi-turn conversations, in vLLM's own way of judging P/D.

vLLM's guide for disaggregated serving puts the P/D proxy and colocated serving on the same GPUs,
raises the request rate until colocated's ITL p99 collapses, and compares ITL p99, TTFT and goodput
(``--goodput ttft:2000 tpot:30``). This suite does that for chat and agents: conversations arrive
open-loop (Poisson) at increasing rates, each of ``WORKLOAD.turns`` turns over an 8k-token history
with think time between them, streamed; every configuration at a rate gets the same conversations
(the seed is the rate's), on fresh engines (nothing cached from the rate before).

Topologies: ``1p1d`` and ``2p2d`` (simulated engines standing for one GPU each; affinity matters
with two of each). Configurations, side by side at each rate:

* ``colocated``: as many colocated engines as the P/D topology has GPUs, each conversation sticking
  to one (a session-affinity balancer), prefix caching on;
* ``plain``: vLLM's standard P/D (engines without ``bidirectional_kv_xfer``), through turnkv without
  session ids: P recomputes every turn from its prefix cache, D reads P's blocks;
* ``vllm-multiturn``: vLLM's multi-turn proxy as a policy (the previous handle pulled, unchecked;
  round-robin routing with several engines, as the proxy does);
* ``adaptive``: turnkv's adaptive policy with the ITL budget at the TPOT SLO, D taking a decode-local
  turn's prefill ``D_CHUNK_TOKENS`` tokens a step (``--long-prefill-token-threshold``; the policy is told),
  the planner passing D's step time, its streams' KV and P's queue; with several P, the ``load-affinity``
  routing (P by the turn's estimated wait there);
* ``adaptive-no-itl``: adaptive without an ITL budget, D as vLLM's default;
* ``adaptive-pull``: adaptive with decode-local off (pull or recompute only);
* ``adaptive-before`` (only when asked for): adaptive without the charge for P's queue
  (``prefill_crowding: 0``: each turn minimises its own TTFT), to compare the two in one run. (Some runs
  in docs/history.md used this name for adaptive without the ITL headroom and the hedge.)
* ``adaptive-first`` (only when asked for): adaptive with ``decode_local_first``: while prefills wait at
  P, a conversation's first turn may run on D too (its whole prompt, a chunk a step), where the policy
  finds that faster and D's ITL checks allow it.

Engines: the simulator at ``--time-scale 1`` by default (durations slept in real time, so engine time
dominates the gateway's and the simulator's own CPU), H200 costs (``sim/costs.py``), the ``h200-ipc``
link (P reads D's blocks at 20 GB/s, D reads P's over ``nvlink``), 18000 KV blocks of 16 tokens per
engine (~0.42 of an H200 for the 8B shape, as in the project's GPU runs), vLLM 0.33 wire shapes.
The sweep stops ``past_collapse`` rates after colocated's ITL p99 collapses (``bench.goodput``), and
within a time budget per topology.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from turnkv.bench.goodput import PointStats, Slo, collapsed, next_rate, point_stats
from turnkv.bench.records import ConfigResult, RunResult
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment
from turnkv.bench.stats import fmt_ms, fmt_ratio
from turnkv.bench.workload import WorkloadSpec

TOPOLOGIES = {"1p1d": (1, 1), "2p2d": (2, 2)}
CONFIGS = (
    "colocated",
    "plain",
    "vllm-multiturn",
    "adaptive",
    "adaptive-no-itl",
    "adaptive-pull",
    "adaptive-before",
    "adaptive-first",
)
DEFAULT_CONFIGS = CONFIGS[:-2]  # adaptive-before and adaptive-first: on request, beside adaptive in one run
BASELINES = ("colocated", "plain", "vllm-multiturn")  # turnkv's goodput is held against the best of them
TURNKV = "adaptive"
# conversations arriving per second on one P and one D; a topology with n of each gets n times these
RATES_1P1D = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0)
KV_BLOCKS = 18000
# D's --long-prefill-token-threshold: a decode-local turn's prefill at most this many tokens a step, so
# that a step stays within the tokens it computes for free. It changes nothing for plain P/D and the
# multi-turn proxy (D prefills one token of their turns); adaptive-no-itl runs D as vLLM's default.
D_CHUNK_TOKENS = 64
DECODE_CACHE_MAX_USAGE = 0.6
# the gateway reads the engines' metrics (D's step time, KV usage, P's prefill times) this often in every
# P/D configuration: the load facts the planner passes the policy are at most this old
SCRAPE_S = 1.0
WORKLOAD = WorkloadSpec(
    conversations=8,
    turns=5,
    system_tokens=8000,
    user_tokens=200,
    answer_tokens=128,
    think_time_s=1.0,
    rate=1.0,
    concurrency=100_000,
    request_timeout_s=120.0,
    duration_s=300.0,
)
DESCRIPTIONS = {
    "colocated": "colocated engines, one per GPU of the P/D topology, conversations sticking to one",
    "plain": "vLLM's standard P/D (no bidirectional KV) through turnkv without session ids",
    "vllm-multiturn": "turnkv --policy vllm-multiturn (vLLM's multi-turn proxy: previous handle pulled, unchecked)",
    "adaptive": "turnkv --policy adaptive with the ITL budget at the TPOT SLO, D prefilling 64 tokens a step, "
    "the engines' load passed (load-affinity routing with several P)",
    "adaptive-no-itl": "turnkv --policy adaptive without an ITL budget",
    "adaptive-pull": "turnkv --policy adaptive with decode-local off",
    "adaptive-before": "adaptive without charging P's compute for the turns queued behind it "
    "(each turn minimises its own TTFT)",
    "adaptive-first": "adaptive with first turns on D too while prefills wait at P (decode_local_first)",
}
# what adaptive-before and adaptive-first change in adaptive's parameters
BEFORE_PARAMS: dict[str, object] = {"prefill_crowding": 0}
FIRST_PARAMS: dict[str, object] = {"decode_local_first": True}


@dataclass(frozen=True)
class SweepOptions:
    topologies: tuple[str, ...] = ("1p1d",)
    rates: tuple[float, ...] | None = None  # per second on one P and one D; default RATES_1P1D
    slo: Slo = field(default_factory=Slo)
    window_s: float = 16.0  # seconds of arrivals per rate (at least min_conversations conversations)
    min_conversations: int = 8
    max_conversations: int | None = None
    past_collapse: int = 2
    budget_s: float = 900.0  # per topology: no new rate starts after it
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        bad = [t for t in self.topologies if t not in TOPOLOGIES] + [c for c in self.configs if c not in CONFIGS]
        if bad:
            raise ValueError(f"unknown topology or configuration: {', '.join(bad)}")
        if self.time_scale <= 0 or self.window_s <= 0 or self.min_conversations < 1 or self.past_collapse < 0:
            raise ValueError("time_scale and window_s must be positive, min_conversations >= 1, past_collapse >= 0")

    def rates_for(self, topology: str) -> tuple[float, ...]:
        p, _ = TOPOLOGIES[topology]
        return tuple(r * p for r in (self.rates or RATES_1P1D))

    def conversations(self, rate: float) -> int:
        n = max(self.min_conversations, round(rate * self.window_s))
        return min(n, self.max_conversations) if self.max_conversations else n


def name(topology: str, config: str, rate: float) -> str:
    return f"{topology}-{config}-r{rate:g}"


def _engine(opts: SweepOptions) -> tuple[str, ...]:
    return (
        "--vllm-compat",
        "0.33",
        "--no-thinking",
        "--link",
        "h200-ipc",
        "--num-gpu-blocks",
        str(KV_BLOCKS),
        "--time-scale",
        f"{opts.time_scale:g}",
    )


def adaptive_params(slo: Slo) -> dict[str, float | int]:
    """What ``adaptive`` is told through its parameters: the ITL budget (the TPOT SLO), D's chunk size
    (D's ``--long-prefill-token-threshold``), and the KV usage above which D's cache is taken to have lost
    the conversation. D's step time, the KV its streams read and P's queue come from the planner
    (``reuse.load``: the engines' metrics and the gateway's prefills in flight)."""
    return {
        "itl_budget_ms": slo.tpot_ms,
        "decode_chunk_tokens": D_CHUNK_TOKENS,
        "decode_cache_max_usage": DECODE_CACHE_MAX_USAGE,
    }


def _deployment(topology: str, config: str, opts: SweepOptions) -> Deployment:
    p, d = TOPOLOGIES[topology]
    engine = _engine(opts)
    if config == "colocated":
        return Deployment("colocated", engine_flags=engine, replicas=p + d)
    env: list[tuple[str, str]] = [
        ("TURNKV_HEALTH_INTERVAL_S", f"{SCRAPE_S:g}"),
        ("TURNKV_SCRAPE_INTERVAL_S", f"{SCRAPE_S:g}"),
    ]
    policy = "adaptive"
    decode: tuple[str, ...] = ("--link", "nvlink")
    if config != "adaptive-no-itl":
        decode += ("--long-prefill-token-threshold", str(D_CHUNK_TOKENS))
    if config == "plain":
        engine += ("--no-bidirectional",)
        env.append(("TURNKV_CONVERSATION_FROM_HISTORY", "false"))
    elif config == "vllm-multiturn":
        policy = "vllm-multiturn"
        # vLLM's proxy keeps every handle until the next turn takes it: no write-back to P in its stead
        env.append(("TURNKV_WRITE_BACK__MODE", "off"))
        if p > 1 or d > 1:
            env.append(("TURNKV_ROUTING", "round-robin"))  # the upstream proxy round-robins P and D
    elif config in ("adaptive", "adaptive-before", "adaptive-first"):
        params: dict[str, object] = {**adaptive_params(opts.slo)}
        changes: dict[str, dict[str, object]] = {"adaptive-before": BEFORE_PARAMS, "adaptive-first": FIRST_PARAMS}
        params.update(changes.get(config, {}))
        env.append(("TURNKV_POLICY__PARAMS", json.dumps(params)))
        if p > 1:
            env.append(("TURNKV_ROUTING", "load-affinity"))  # P by the turn's wait there, its cache counted
    elif config == "adaptive-pull":
        env.append(("TURNKV_POLICY__PARAMS", json.dumps({"decode_local": False})))
    return Deployment(
        "pd",
        engine_flags=engine,
        decode_flags=decode,
        prefills=p,
        decodes=d,
        gateway_flags=("--policy", policy),
        gateway_env=tuple(env),
    )


def bench(topology: str, config: str, rate: float, opts: SweepOptions) -> Bench:
    """One configuration at one rate (conversations per simulated second), on its own engines."""
    k = opts.time_scale
    wl = replace(
        WORKLOAD,
        conversations=opts.conversations(rate),
        rate=rate / k,
        think_time_s=WORKLOAD.think_time_s * k,
        request_timeout_s=WORKLOAD.request_timeout_s * k,
        duration_s=WORKLOAD.duration_s * k,
        session_header=config not in ("colocated", "plain"),
        seed=int(round(rate * 1000)) + (0 if topology == "1p1d" else 7),
    )
    tags = {
        "suite": "goodput",
        "topology": topology,
        "config": config,
        "rate": rate,
        "time_scale": k,
        "slo": {"ttft_ms": opts.slo.ttft_ms, "tpot_ms": opts.slo.tpot_ms},
    }
    desc = f"{topology}, {rate:g} conversations/s: {DESCRIPTIONS[config]}"
    plan = ConfigPlan(name(topology, config, rate), f"{topology} r{rate:g}", desc, wl, tags)
    return Bench(_deployment(topology, config, opts), (plan,))


def sweep(
    opts: SweepOptions, done: Sequence[ConfigResult], *, clock: Callable[[], float] = time.monotonic
) -> Iterator[Bench]:
    """The benches of the sweep, rate by rate. ``done`` is the run's results so far (the runner adds to
    it before asking for the next bench), from which colocated's collapse is read."""
    now = clock
    for topo in opts.topologies:
        rates = opts.rates_for(topo)
        started, collapsed_at = now(), None
        ran: list[float] = []
        while True:
            rate = next_rate(
                rates, ran, collapsed_at, past=opts.past_collapse, elapsed_s=now() - started, budget_s=opts.budget_s
            )
            if rate is None:
                break
            for config in opts.configs:
                yield bench(topo, config, rate, opts)
            ran.append(rate)
            co = next((c for c in done if c.name == name(topo, "colocated", rate)), None)
            if co is not None and collapsed_at is None and collapsed(stats(co).itl_p99, opts.slo):
                collapsed_at = rate


def benches(conversations: int | None = None) -> list[Bench]:
    """The sweep's first rate of each topology (``turnkv bench scenarios`` runs the sweep itself)."""
    opts = SweepOptions(topologies=tuple(TOPOLOGIES), min_conversations=conversations or 8)
    return [bench(t, c, opts.rates_for(t)[0], opts) for t in opts.topologies for c in opts.configs]


def stats(c: ConfigResult) -> PointStats:
    t = c.meta.get("tags", {})
    slo = Slo(**t.get("slo", {}))
    return point_stats(
        c.requests,
        rate=float(t.get("rate", 0.0)),
        slo=slo,
        time_scale=float(t.get("time_scale", 1.0)),
        conversations=int(c.workload.get("conversations", 0)),
    )


# -- analysis ------------------------------------------------------------------------------------

Grid = dict[str, dict[float, dict[str, PointStats]]]  # topology -> rate -> config -> stats


def grid(configs: Sequence[ConfigResult]) -> tuple[Grid, Slo]:
    out: Grid = {}
    slo = Slo()
    for c in configs:
        t = c.meta.get("tags", {})
        if t.get("suite") != "goodput":
            continue
        slo = Slo(**t.get("slo", {}))
        out.setdefault(t["topology"], {}).setdefault(float(t["rate"]), {})[t["config"]] = stats(c)
    return {k: dict(sorted(v.items())) for k, v in out.items()}, slo


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


@dataclass(frozen=True)
class Check:
    target: str
    where: str
    measured: float
    limit: float
    at_least: bool  # the measured ratio must be >= limit (else <=)

    @property
    def verdict(self) -> str:
        if math.isnan(self.measured):
            return "-"
        ok = self.measured >= self.limit if self.at_least else self.measured <= self.limit
        return "met" if ok else "MISSED"


def checks(g: Grid) -> list[Check]:
    """The targets, per topology: at every rate turnkv's goodput >= the best baseline's and its ITL
    p99 <= 1.10x plain P/D's; at the rate where plain P/D's goodput peaks, >= 1.5x plain P/D's."""
    out: list[Check] = []
    for topo, rates in g.items():
        for rate, cfg in rates.items():
            tk = cfg.get(TURNKV)
            if tk is None:
                continue
            base = {b: cfg[b].goodput for b in BASELINES if b in cfg}
            if base:
                best = max(base, key=lambda b: base[b])
                out.append(
                    Check(
                        f"goodput >= best of {', '.join(base)}",
                        f"{topo} r{rate:g} (best: {best})",
                        _ratio(tk.goodput, base[best]),
                        1.0,
                        True,
                    )
                )
            if "plain" in cfg:
                out.append(
                    Check(
                        "ITL p99 <= 1.10x plain P/D",
                        f"{topo} r{rate:g}",
                        _ratio(tk.itl_p99, cfg["plain"].itl_p99),
                        1.10,
                        False,
                    )
                )
        plain = {r: cfg["plain"].goodput for r, cfg in rates.items() if "plain" in cfg and TURNKV in cfg}
        if plain:
            peak = max(plain, key=lambda r: plain[r])
            out.append(
                Check(
                    "goodput >= 1.5x plain P/D where plain P/D peaks",
                    f"{topo} r{peak:g}",
                    _ratio(rates[peak][TURNKV].goodput, plain[peak]),
                    1.5,
                    True,
                )
            )
    return out


def _configs(rates: dict[float, dict[str, PointStats]]) -> list[str]:
    seen = {c for cfg in rates.values() for c in cfg}
    return [c for c in CONFIGS if c in seen]


def _table(rates: dict[float, dict[str, PointStats]], cell: str) -> str:
    names = _configs(rates)
    rows = []
    for rate, cfg in rates.items():
        row: list[object] = [f"{rate:g}"]
        for n in names:
            s = cfg.get(n)
            if s is None:
                row.append("")
            elif cell == "goodput":
                row.append(f"{s.goodput:.2f} ({s.attainment:.0%}; {s.goodput_wall:.2f})")
            elif cell == "ttft":
                row.append(
                    f"{fmt_ms(s.ttft_first_p50)} / {fmt_ms(s.ttft_first_p99)} | "
                    f"{fmt_ms(s.ttft_later_p50)} / {fmt_ms(s.ttft_later_p99)}"
                )
            elif cell == "itl":
                row.append(f"{fmt_ms(s.itl_p50)} / {fmt_ms(s.itl_p99)} / {fmt_ms(s.itl_max)}")
            else:
                row.append(f"{fmt_ms(s.tpot_p50)} / {fmt_ms(s.tpot_p99)}")
        rows.append(row)
    return md_table(["conversations/s", *names], rows)


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    g, slo = grid(configs)
    groups: dict[str, list[str]] = {}
    for c in configs:
        if c.meta.get("tags", {}).get("suite") == "goodput":
            groups.setdefault(c.group, []).append(c.name)
    parts = [
        "![goodput, TTFT p99 and ITL p99 against the rate](goodput_vs_rate.png)",
        "",
        f"SLOs: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms (simulated time). Goodput: turns that "
        "met both per second of arrivals (conversations / rate; see turnkv.bench.goodput), attainment: their "
        "share of the turns sent. Colocated's ITL p99 collapses "
        f"above {slo.collapse_itl_ms:g} ms. Each rate ran every configuration on fresh engines with the same "
        "conversations.",
        "",
    ]
    for topo, rates in g.items():
        co = [r for r, cfg in rates.items() if "colocated" in cfg and collapsed(cfg["colocated"].itl_p99, slo)]
        parts += [
            f"## {topo}",
            "",
            f"Colocated's ITL p99 collapsed at {co[0]:g} conversations/s."
            if co
            else "Colocated's ITL p99 did not collapse within the sweep.",
            "",
            "### Goodput, turns/s of arrivals (attainment; turns/s of the run's wall time, as vLLM counts)",
            "",
            _table(rates, "goodput"),
            "",
            "### TTFT ms: first turns p50 / p99 | later turns p50 / p99",
            "",
            _table(rates, "ttft"),
            "",
            "### ITL ms: p50 / p99 / max",
            "",
            _table(rates, "itl"),
            "",
            "### TPOT ms: p50 / p99",
            "",
            _table(rates, "tpot"),
            "",
            "### turnkv's actions on later turns",
            "",
            md_table(
                ["conversations/s", *[n for n in _configs(rates) if n.startswith(("adaptive", "vllm"))]],
                [
                    [
                        f"{r:g}",
                        *[
                            ", ".join(f"{k} {v}" for k, v in sorted(cfg[n].actions.items())) if n in cfg else ""
                            for n in _configs(rates)
                            if n.startswith(("adaptive", "vllm"))
                        ],
                    ]
                    for r, cfg in rates.items()
                ],
            ),
            "",
        ]
    cs = checks(g)
    parts += [
        "## Targets",
        "",
        md_table(
            ["target", "where", "measured", "limit", "met"],
            [
                [c.target, c.where, fmt_ratio(c.measured), f"{'>=' if c.at_least else '<='} {c.limit:.2f}x", c.verdict]
                for c in cs
            ],
        ),
        "",
    ]
    return "\n".join(parts), groups


def write_summary(run: RunResult, path: Path) -> None:
    """Every point's statistics and the targets, without the per-request records (small enough to keep)."""
    g, slo = grid(run.configs)
    doc = {
        "suite": run.suite,
        "command": run.command,
        "created": run.created,
        "machine": run.machine,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "points": {
            topo: {f"{rate:g}": {c: st.to_dict() for c, st in cfg.items()} for rate, cfg in rates.items()}
            for topo, rates in g.items()
        },
        "targets": [
            {"target": c.target, "where": c.where, "measured": c.measured, "limit": c.limit, "verdict": c.verdict}
            for c in checks(g)
        ],
    }
    path.write_text(json.dumps(_no_nan(doc), indent=1))


def _no_nan(x: Any) -> Any:
    """JSON has no NaN: nothing measured is written as null."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def plot(configs: Sequence[ConfigResult], path: Path) -> None:
    """Goodput, later turns' TTFT p99 and ITL p99 against the rate; a row per topology."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g, slo = grid(configs)
    if not g:
        return
    fig, axes = plt.subplots(len(g), 3, figsize=(15, 3.8 * len(g)), squeeze=False)
    for row, (topo, rates) in zip(axes, g.items(), strict=True):
        for i, n in enumerate(_configs(rates)):
            pts = [(r, cfg[n]) for r, cfg in rates.items() if n in cfg]
            xs = [r for r, _ in pts]
            style = {"color": f"C{i}", "marker": "o", "ms": 3, "lw": 2.2 if n == TURNKV else 1.2, "label": n}
            row[0].plot(xs, [s.goodput for _, s in pts], **style)
            row[1].plot(xs, [s.ttft_later_p99 for _, s in pts], **style)
            row[2].plot(xs, [s.itl_p99 for _, s in pts], **style)
        row[1].axhline(slo.ttft_ms, color="k", lw=0.8, ls=":")
        row[2].axhline(slo.tpot_ms, color="k", lw=0.8, ls=":")
        for ax, what in zip(row, ("goodput, turns/s", "TTFT p99 of later turns, ms", "ITL p99, ms"), strict=True):
            ax.set_xlabel("conversations/s")
            ax.set_ylabel(what)
            ax.set_title(f"{topo}: {what}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        row[1].set_yscale("log")
        row[2].set_yscale("log")
        row[0].legend(fontsize=7)
    fig.suptitle(
        f"turnkv bench goodput (simulated H200; SLOs TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms)", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
