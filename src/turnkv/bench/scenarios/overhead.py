"""The overhead suite: what turnkv itself costs, against engines that cost nothing.

Engines run with ``--time-scale 0`` (no simulated compute; their real CPU remains) and
``--no-thinking`` (32 content chunks per answer). The gateway is pinned to CPU 1 and everything
else (engines, redis-server, this load generator) to CPU 0, so the gateway's CPU time and its
added latency are not mixed with the engines'. The baseline for added latency is ``pd-direct``:
the load generator runs vLLM's P/D handshake itself, so both sides make the same engine calls and
the difference is turnkv's two proxy hops (P leg and D leg) and its work. ITL is measured with
engines that pace decode steps (``--decode-itl-ms 20``, no other cost) at 256 concurrent streams.
Redis round trips are counted in a separate pass through a counting relay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from turnkv.bench.records import ConfigResult
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment
from turnkv.bench.stats import fmt_ms, percentile, summarize
from turnkv.bench.workload import WorkloadSpec

ZERO = ("--vllm-compat", "0.33", "--time-scale", "0", "--no-thinking")
PACED = ("--vllm-compat", "0.33", "--no-thinking", "--decode-itl-ms", "20", "--prefill-floor-ms", "0",
         "--prefill-us-per-token", "0", "--api-overhead-ms", "0", "--link-latency-ms", "0", "--link-gbps", "1000")
GATEWAY = ("--policy", "never-pull")  # same engine legs as pd-direct on every turn
CONCURRENCY = (1, 8, 32, 64)
STREAMS = 256
CHUNKS = 32

BASE = WorkloadSpec(turns=1, system_tokens=500, user_tokens=50, answer_tokens=CHUNKS, think_time_s=0.0, rate=0.0,
                    request_timeout_s=60.0, duration_s=120.0)
WARMUP = replace(BASE, conversations=40, concurrency=4, seed=999, session_header=True)


def _sweep(prefix: str, group: str, desc: str, session: bool, seed0: int) -> tuple[ConfigPlan, ...]:
    plans = []
    for i, c in enumerate(CONCURRENCY):
        n = 150 if c == 1 else max(200, 10 * c)
        wl = replace(BASE, conversations=n, concurrency=c, session_header=session, seed=seed0 + i)
        plans.append(ConfigPlan(f"{prefix}-c{c}", group, f"{desc}, {c} concurrent", wl,
                                {"overhead": prefix, "concurrency": c}))
    return tuple(plans)


def benches(conversations: int | None = None) -> list[Bench]:
    streams = replace(BASE, conversations=STREAMS, concurrency=STREAMS, answer_tokens=64, system_tokens=200,
                      session_header=False)
    count = replace(BASE, conversations=conversations or 10, turns=4, concurrency=1, session_header=True, seed=77)
    return [
        Bench(Deployment("colocated", engine_flags=ZERO, pin=True),
              _sweep("direct-colocated", "ttft", "one zero-cost colocated engine, direct", False, 100),
              warmup=replace(WARMUP, session_header=False)),
        Bench(Deployment("pd-direct", engine_flags=ZERO, pin=True),
              _sweep("pd-direct", "ttft", "zero-cost P and D, the client runs the P/D handshake", False, 200),
              warmup=replace(WARMUP, session_header=False)),
        Bench(Deployment("pd", engine_flags=ZERO, gateway_flags=GATEWAY, pin=True),
              _sweep("turnkv-stateless", "ttft", "turnkv, no session ids", False, 300)
              + _sweep("turnkv-session", "ttft", "turnkv, X-Session-ID, in-process store", True, 400),
              warmup=WARMUP),
        Bench(Deployment("pd", engine_flags=ZERO, gateway_flags=GATEWAY, redis=True, pin=True),
              _sweep("turnkv-redis", "ttft", "turnkv, X-Session-ID, Redis store", True, 500), warmup=WARMUP),
        Bench(Deployment("pd-direct", engine_flags=PACED, pin=True),
              (ConfigPlan("itl-pd-direct", "itl", f"paced engines (20 ms steps), {STREAMS} streams, pd-direct",
                          replace(streams, seed=600), {"overhead": "itl-pd-direct"}),),
              warmup=replace(WARMUP, session_header=False)),
        Bench(Deployment("pd", engine_flags=PACED, gateway_flags=GATEWAY, pin=True),
              (ConfigPlan("itl-turnkv", "itl", f"paced engines (20 ms steps), {STREAMS} streams, through turnkv",
                          replace(streams, seed=700), {"overhead": "itl-turnkv"}),),
              warmup=replace(WARMUP, session_header=False)),
        Bench(Deployment("pd", engine_flags=ZERO, gateway_flags=("--policy", "adaptive"), redis=True,
                         count_redis_round_trips=True),
              (ConfigPlan("redis-round-trips", "redis", "turnkv + Redis through a counting relay, 4-turn "
                          "conversations, adaptive policy", count, {"overhead": "redis-count"}),)),
    ]


def _nan(x: float) -> bool:
    return math.isnan(x)


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    by = {c.name: c for c in configs}
    out = ["## Added TTFT (ms): through turnkv minus pd-direct, same concurrency", ""]
    rows, cpu_rows, checks = [], [], []
    for c in CONCURRENCY:
        base = by.get(f"pd-direct-c{c}")
        colo = by.get(f"direct-colocated-c{c}")
        b = summarize(base.requests) if base else None
        col = summarize(colo.requests) if colo else None
        for name in ("turnkv-stateless", "turnkv-session", "turnkv-redis"):
            cfg = by.get(f"{name}-c{c}")
            if cfg is None or b is None:
                continue
            s = summarize(cfg.requests)
            add50, add99 = s.ttft_p50 - b.ttft_p50, s.ttft_p99 - b.ttft_p99
            rows.append([c, name, s.n, s.errors, fmt_ms(col.ttft_p50) if col else "-", fmt_ms(b.ttft_p50),
                         fmt_ms(b.ttft_p99), fmt_ms(s.ttft_p50), fmt_ms(s.ttft_p99), f"{add50:+.2f}",
                         f"{add99:+.2f}", f"{add50 / 2:+.2f}"])
            checks.append(("added TTFT p50 per hop <= 1 ms", f"{name}, C={c}", add50 / 2, 1.0, "ms"))
    out += ["Two proxy hops per turn (P leg, D leg), so *per hop* = added p50 / 2. Sessions add a render call to "
            "P and the store round trips, on the critical path.", "",
            md_table(["C", "config", "n", "errors", "colocated p50", "pd-direct p50", "pd-direct p99",
                      "turnkv p50", "turnkv p99", "added p50", "added p99", "added p50 per hop"], rows), ""]
    for cfg in configs:
        if cfg.group != "ttft" or "gateway_cpu_s" not in cfg.meta:
            continue
        n = len(cfg.requests)
        cpu_ms = cfg.meta["gateway_cpu_s"] * 1e3 / max(n, 1)
        util = cfg.meta["gateway_cpu_s"] / cfg.wall_s if cfg.wall_s else math.nan
        cpu_rows.append([cfg.name, n, f"{cpu_ms:.2f}", f"{1e3 / cpu_ms:.0f}" if cpu_ms else "-",
                         f"{n / cfg.wall_s:.0f}", f"{util:.0%}"])
        if cfg.meta.get("tags", {}).get("concurrency") == max(CONCURRENCY):
            checks.append(("streamed req/s per core >= 1000 (32 chunks)", cfg.name, 1e3 / cpu_ms, 1000.0, "req/s"))
    out += ["## Gateway CPU per request (32 chunks), from /proc/<pid>/stat", "",
            "req/s per core = 1000 / CPU ms per request; *achieved* is requests / wall time of the load (the "
            "engines and the load generator share the other core, so they may be the bottleneck).", "",
            md_table(["config", "requests", "gateway CPU ms/request", "req/s per core", "achieved req/s",
                      "gateway CPU use"], cpu_rows), ""]
    d, t = by.get("itl-pd-direct"), by.get("itl-turnkv")
    if d and t:
        sd, st = summarize(d.requests), summarize(t.requests)
        itl_d = [x for r in d.requests if r.ok for x in r.itl_ms]
        itl_t = [x for r in t.requests if r.ok for x in r.itl_ms]
        out += [f"## ITL at {STREAMS} concurrent streams (ms)", "",
                md_table(["config", "streams", "errors", "ITL p50", "ITL p90", "ITL p99", "TTFT p50"],
                         [[x.name, s.n, s.errors, fmt_ms(s.itl_p50), fmt_ms(percentile(i, 90)), fmt_ms(s.itl_p99),
                           fmt_ms(s.ttft_p50)] for x, s, i in ((d, sd, itl_d), (t, st, itl_t))]), "",
                f"Added ITL p99: {st.itl_p99 - sd.itl_p99:+.2f} ms.", ""]
        checks.append(("added ITL p99 <= 2 ms at 256 streams", "itl-turnkv", st.itl_p99 - sd.itl_p99, 2.0, "ms"))
    rc = by.get("redis-round-trips")
    if rc and "redis_round_trips" in rc.meta:
        turns = len(rc.requests)
        rt = rc.meta["redis_round_trips"]
        per_cmd = ", ".join(f"{k} {v / turns:.2f}" for k, v in sorted(rc.meta.get("redis_round_trips_by_command",
                                                                                    {}).items()))
        cmds = ", ".join(f"{k} {v}" for k, v in sorted(rc.meta.get("redis_commands", {}).items()))
        out += ["## Redis round trips per turn", "",
                f"{rt} round trips for {turns} turns ({turns // max(rc.workload['turns'], 1)} conversations of "
                f"{rc.workload['turns']} turns): **{rt / turns:.2f} per turn**; by first command, per turn: "
                f"{per_cmd}. Redis commands executed (INFO commandstats delta): {cmds}. The gateway's background "
                "pin report (one script call per scrape interval, 5 s) is included.", ""]
        checks.append(("Redis round trips per turn <= 2", "redis-round-trips", rt / turns, 2.0, ""))
    out += ["## Targets (issue 4)", "",
            md_table(["target", "where", "measured", "limit", "met"],
                     [[n, w, "-" if _nan(x) else f"{x:.2f} {u}".strip(), f"{lim:g} {u}".strip(),
                       "-" if _nan(x) else ("met" if (x >= lim if "req/s" in n else x <= lim) else "MISSED")]
                      for n, w, x, lim, u in checks]), ""]
    return "\n".join(out), {"redis-round-trips: TTFT by turn of 4-turn conversations": ["redis-round-trips"]}


def plot(configs: Sequence[ConfigResult], path: Path) -> None:
    """TTFT p50 (solid) and p99 (dashed) against concurrency, one line per way of reaching the engines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    prefixes = ("direct-colocated", "pd-direct", "turnkv-stateless", "turnkv-session", "turnkv-redis")
    by = {c.name: c for c in configs}
    for i, prefix in enumerate(prefixes):
        pts = [(c, summarize(by[f"{prefix}-c{c}"].requests)) for c in CONCURRENCY if f"{prefix}-c{c}" in by]
        if not pts:
            continue
        xs = [c for c, _ in pts]
        ax.plot(xs, [s.ttft_p50 for _, s in pts], "o-", color=f"C{i}", label=prefix, ms=3)
        ax.plot(xs, [s.ttft_p99 for _, s in pts], "--", color=f"C{i}", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("TTFT ms (p50 solid, p99 dashed)")
    ax.set_title("Zero-cost engines: TTFT direct vs through turnkv", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
