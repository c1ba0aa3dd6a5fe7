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
PACED = (
    "--vllm-compat",
    "0.33",
    "--no-thinking",
    "--decode-itl-ms",
    "20",
    "--prefill-floor-ms",
    "0",
    "--prefill-us-per-token",
    "0",
    "--prefill-attn-ns",
    "0",
    "--decode-ctx-ns",
    "0",
    "--api-overhead-ms",
    "0",
    "--link-latency-ms",
    "0",
    "--link-gbps",
    "1000",
)
GATEWAY = ("--policy", "never-pull")  # same engine legs as pd-direct on every turn
# With bidirectional KV, D pins every answered request's blocks for decoder_kv_blocks_ttl, and nothing
# releases those of requests without a session (pd-direct, or turnkv stateless): at hundreds of
# requests per second D runs out of KV and fails requests. D gets a large pool and a 20 s TTL (the
# gateway is told the same TTL), so that no run here is limited by pinned memory.
D_MEMORY = ("--num-gpu-blocks", "200000", "--decoder-kv-blocks-ttl", "20")
# turnkv-stateless measures requests without session ids as plain P/D: no conversation found from messages;
# the handles nobody will pull are left to D's TTL as pd-direct leaves them (D has room for them all), not
# released one request each (decode_memory.unused_share, gateway/pins.py)
GW_ENV = (
    ("TURNKV_DECODER_KV_BLOCKS_TTL", "20"),
    ("TURNKV_CONVERSATION_FROM_HISTORY", "false"),
    ("TURNKV_DECODE_MEMORY__UNUSED_SHARE", "1"),
)
# (label, workload changes): one at a time, Poisson arrivals at 25 and 50 requests/s (below saturation on
# this machine), then closed loops of 8, 32 and 64 concurrent requests (core 0 saturates)
LOADS: tuple[tuple[str, dict[str, float]], ...] = (
    ("c1", {"concurrency": 1, "conversations": 150}),
    ("r25", {"rate": 25.0, "concurrency": 64, "conversations": 250}),
    ("r50", {"rate": 50.0, "concurrency": 64, "conversations": 400}),
    ("c8", {"concurrency": 8, "conversations": 200}),
    ("c32", {"concurrency": 32, "conversations": 320}),
    ("c64", {"concurrency": 64, "conversations": 640}),
)
UNSATURATED = ("c1", "r25", "r50")
SETUP_COMMANDS = ("hello", "client", "script", "ping", "info", "select", "auth")
STREAMS = 256
# targets: turnkv's gateway CPU per request over the bare relay's (0: reported, no target)
RATIO_TARGETS = (("turnkv-stateless", 1.15), ("turnkv-session", 0.0), ("turnkv-redis", 1.3))
CHUNKS = 32

BASE = WorkloadSpec(
    turns=1,
    system_tokens=500,
    user_tokens=50,
    answer_tokens=CHUNKS,
    think_time_s=0.0,
    rate=0.0,
    request_timeout_s=60.0,
    duration_s=120.0,
)
WARMUP = replace(BASE, conversations=40, concurrency=4, seed=999, session_header=True)
LONG = replace(BASE, turns=4, conversations=6, concurrency=1, user_tokens=150, think_time_s=0.05)
HISTORIES = (2000, 16000)


def _long(prefix: str, desc: str, session: bool, seed0: int) -> tuple[ConfigPlan, ...]:
    return tuple(
        ConfigPlan(
            f"long-{prefix}-{h // 1000}k",
            "long",
            f"{desc}, {h // 1000}k-token history, 4 turns, 1 at a time",
            replace(LONG, system_tokens=h, session_header=session, seed=seed0 + i),
            {"overhead": f"long-{prefix}", "history": h},
        )
        for i, h in enumerate(HISTORIES)
    )


def _sweep(prefix: str, group: str, desc: str, session: bool, seed0: int) -> tuple[ConfigPlan, ...]:
    plans = []
    for i, (label, changes) in enumerate(LOADS):
        wl = replace(BASE, session_header=session, seed=seed0 + i, **changes)  # type: ignore[arg-type]
        load = f"{wl.rate:g} requests/s (Poisson)" if wl.rate else f"{wl.concurrency} concurrent"
        plans.append(ConfigPlan(f"{prefix}-{label}", group, f"{desc}, {load}", wl, {"overhead": prefix, "load": label}))
    return tuple(plans)


def _direct(engine: tuple[str, ...]) -> Deployment:
    return Deployment("pd-direct", engine_flags=engine, decode_flags=D_MEMORY, pin=True)


def _turnkv(
    engine: tuple[str, ...],
    gateway: tuple[str, ...] = GATEWAY,
    *,
    redis: bool = False,
    pin: bool = False,
    count_redis_round_trips: bool = False,
) -> Deployment:
    return Deployment(
        "pd",
        engine_flags=engine,
        decode_flags=D_MEMORY,
        gateway_flags=gateway,
        gateway_env=GW_ENV,
        redis=redis,
        pin=pin,
        count_redis_round_trips=count_redis_round_trips,
    )


def _itl_bench(deployment: Deployment, name: str, how: str, seed: int) -> Bench:
    """``STREAMS`` streams of 64 tokens at once on paced engines (20 ms steps): the ITL ``how`` they go."""
    streams = replace(
        BASE, conversations=STREAMS, concurrency=STREAMS, answer_tokens=64, system_tokens=200, session_header=False
    )
    plan = ConfigPlan(
        f"itl-{name}",
        "itl",
        f"paced engines (20 ms steps), {STREAMS} streams, {how}",
        replace(streams, seed=seed),
        {"overhead": f"itl-{name}"},
    )
    return Bench(deployment, (plan,), warmup=replace(WARMUP, session_header=False))


def benches(conversations: int | None = None) -> list[Bench]:
    count = replace(BASE, conversations=conversations or 10, turns=4, concurrency=1, session_header=True, seed=77)
    stateless_warmup = replace(WARMUP, session_header=False)
    return [
        Bench(
            Deployment("colocated", engine_flags=ZERO, pin=True),
            _sweep("direct-colocated", "ttft", "one zero-cost colocated engine, direct", False, 100),
            warmup=stateless_warmup,
        ),
        Bench(
            Deployment("relay", engine_flags=ZERO, pin=True),
            _sweep(
                "bare-relay",
                "ttft",
                "a bare aiohttp.web relay (no parsing) in front of one zero-cost engine",
                False,
                150,
            ),
            warmup=stateless_warmup,
        ),
        Bench(
            Deployment("pd-relay", engine_flags=ZERO, decode_flags=D_MEMORY, pin=True),
            _sweep(
                "bare-pd-relay",
                "ttft",
                "the bare relay making vLLM's P/D handshake (orjson, no checks) in front of zero-cost P and D",
                False,
                170,
            ),
            warmup=stateless_warmup,
        ),
        Bench(
            Deployment("pd-relay", engine_flags=ZERO, decode_flags=D_MEMORY, pin=True, relay_server="uvicorn"),
            _sweep(
                "bare-pd-relay-uvicorn",
                "ttft",
                "the bare P/D relay as a plain ASGI app on uvicorn (turnkv's server stack, none of its code)",
                False,
                180,
            ),
            warmup=stateless_warmup,
        ),
        Bench(
            _direct(ZERO),
            _sweep("pd-direct", "ttft", "zero-cost P and D, the client runs the P/D handshake", False, 200),
            warmup=stateless_warmup,
        ),
        Bench(
            _turnkv(ZERO, pin=True),
            _sweep("turnkv-stateless", "ttft", "turnkv, no session ids", False, 300)
            + _sweep("turnkv-session", "ttft", "turnkv, X-Session-ID, in-process store", True, 400),
            warmup=WARMUP,
        ),
        Bench(
            _turnkv(ZERO, redis=True, pin=True),
            _sweep("turnkv-redis", "ttft", "turnkv, X-Session-ID, Redis store", True, 500),
            warmup=WARMUP,
        ),
        _itl_bench(_direct(PACED), "pd-direct", "pd-direct", 600),
        _itl_bench(
            Deployment("pd-relay", engine_flags=PACED, decode_flags=D_MEMORY, pin=True),
            "bare-pd-relay",
            "through the bare P/D relay",
            650,
        ),
        _itl_bench(_turnkv(PACED, pin=True), "turnkv", "through turnkv", 700),
        Bench(
            Deployment("colocated", engine_flags=ZERO, pin=True),
            _long("colocated", "zero-cost colocated engine, direct", False, 800),
        ),
        Bench(_direct(ZERO), _long("pd-direct", "zero-cost P and D, the client runs the P/D handshake", False, 810)),
        Bench(
            _turnkv(ZERO, ("--policy", "adaptive"), pin=True),
            _long("turnkv", "turnkv (adaptive), X-Session-ID, in-process store", True, 820),
        ),
        Bench(
            _turnkv(ZERO, ("--policy", "adaptive"), redis=True, count_redis_round_trips=True),
            (
                ConfigPlan(
                    "redis-round-trips",
                    "redis",
                    "turnkv + Redis through a counting relay, 4-turn conversations, adaptive policy",
                    count,
                    {"overhead": "redis-count"},
                ),
            ),
        ),
    ]


def _nan(x: float) -> bool:
    return math.isnan(x)


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    by = {c.name: c for c in configs}
    out = ["## Added TTFT (ms): through turnkv minus pd-direct, same load", ""]
    rows, cpu_rows, checks = [], [], []
    for c, _ in LOADS:
        base = by.get(f"pd-direct-{c}")
        colo = by.get(f"direct-colocated-{c}")
        b = summarize(base.requests) if base else None
        col = summarize(colo.requests) if colo else None
        for name in ("turnkv-stateless", "turnkv-session", "turnkv-redis"):
            cfg = by.get(f"{name}-{c}")
            if cfg is None or b is None:
                continue
            s = summarize(cfg.requests)
            add50, add99 = s.ttft_p50 - b.ttft_p50, s.ttft_p99 - b.ttft_p99
            rows.append(
                [
                    c,
                    name,
                    s.n,
                    s.errors,
                    fmt_ms(col.ttft_p50) if col else "-",
                    fmt_ms(b.ttft_p50),
                    fmt_ms(b.ttft_p99),
                    fmt_ms(s.ttft_p50),
                    fmt_ms(s.ttft_p99),
                    f"{add50:+.2f}",
                    f"{add99:+.2f}",
                    f"{add50 / 2:+.2f}",
                ]
            )
            if c in UNSATURATED:
                checks.append(("added TTFT p50 per hop <= 1 ms", f"{name}, {c}", add50 / 2, 1.0, "ms"))
    out += [
        "Two proxy hops per turn (P leg, D leg), so *per hop* = added p50 / 2. Sessions add a render call to "
        "P and the store round trips, on the critical path. Loads: c1 = one request at a time; r25/r50 = "
        "Poisson arrivals at 25/50 requests/s; c8/c32/c64 = closed loops that saturate CPU 0 (engines and "
        "load generator), where the difference measures that core, not the gateway (pd-direct does its P/D "
        "handshake on CPU 0, turnkv on CPU 1), so only c1, r25 and r50 are held against the target.",
        "",
        md_table(
            [
                "load",
                "config",
                "n",
                "errors",
                "colocated p50",
                "pd-direct p50",
                "pd-direct p99",
                "turnkv p50",
                "turnkv p99",
                "added p50",
                "added p99",
                "added p50 per hop",
            ],
            rows,
        ),
        "",
    ]
    for cfg in configs:
        if cfg.group != "ttft" or "gateway_cpu_s" not in cfg.meta:
            continue
        n = len(cfg.requests)
        cpu_ms = cfg.meta["gateway_cpu_s"] * 1e3 / max(n, 1)
        util = cfg.meta["gateway_cpu_s"] / cfg.wall_s if cfg.wall_s else math.nan
        cpu_rows.append(
            [
                cfg.name,
                n,
                f"{cpu_ms:.2f}",
                f"{1e3 / cpu_ms:.0f}" if cpu_ms else "-",
                f"{n / cfg.wall_s:.0f}",
                f"{util:.0%}",
            ]
        )
        if cfg.meta.get("tags", {}).get("load") == LOADS[-1][0] and cfg.name.startswith("turnkv"):
            checks.append(("streamed req/s per core >= 1000 (32 chunks)", cfg.name, 1e3 / cpu_ms, 1000.0, "req/s"))
    out += _ratio_table(configs, checks)
    out += [
        "## Gateway CPU per request (32 chunks), from /proc/<pid>/stat",
        "",
        "req/s per core = 1000 / CPU ms per request; *achieved* is requests / wall time of the load (the "
        "engines and the load generator share the other core, so they may be the bottleneck).",
        "",
        md_table(
            ["config", "requests", "gateway CPU ms/request", "req/s per core", "achieved req/s", "gateway CPU use"],
            cpu_rows,
        ),
        "",
    ]
    out += _itl_table(by, checks)
    rc = by.get("redis-round-trips")
    if rc and "redis_round_trips" in rc.meta:
        turns = len(rc.requests)
        rt = rc.meta["redis_round_trips"]
        by_cmd = rc.meta.get("redis_round_trips_by_command", {})
        setup = sum(v for k, v in by_cmd.items() if k.split()[0] in SETUP_COMMANDS)
        # a script's first EVALSHA fails with NOSCRIPT and is sent again as EVAL (after SCRIPT LOAD in a pipeline)
        setup += by_cmd.get("script", 0) + by_cmd.get("eval", 0)
        # an operation done at least once per two turns is per-turn work; rarer ones are background loops
        background = sum(v for k, v in by_cmd.items() if k.split()[0] not in SETUP_COMMANDS and v < turns / 2)
        per_cmd = ", ".join(f"{k} {v / turns:.2f}" for k, v in sorted(by_cmd.items()))
        cmds = ", ".join(f"{k} {v}" for k, v in sorted(rc.meta.get("redis_commands", {}).items()))
        out += [
            "## Redis round trips per turn",
            "",
            f"{rt} round trips for {turns} turns ({turns // max(rc.workload['turns'], 1)} conversations of "
            f"{rc.workload['turns']} turns): {setup} set connections and scripts up (HELLO, CLIENT SETINFO, "
            f"SCRIPT LOAD and the EVALSHA it retries), "
            f"{background} belong to background loops (operations seen fewer than once per two turns, e.g. "
            f"the 5 s pin report), leaving **{(rt - setup - background) / turns:.2f} per turn**. By first "
            f"command (EVALSHA with its script's sha prefix), per turn: {per_cmd}. Commands executed (INFO "
            f"commandstats delta): {cmds}.",
            "",
        ]
        checks.append(
            ("Redis round trips per turn <= 2", "redis-round-trips", (rt - setup - background) / turns, 2.0, "")
        )
    out += _long_table(by)
    out += [
        "## Targets",
        "",
        md_table(
            ["target", "where", "measured", "limit", "met"],
            [
                [
                    n,
                    w,
                    "-" if _nan(x) else f"{x:.2f} {u}".strip(),
                    f"{lim:g} {u}".strip(),
                    "-" if _nan(x) else ("met" if (x >= lim if "req/s" in n else x <= lim) else "MISSED"),
                ]
                for n, w, x, lim, u in checks
            ],
        ),
        "",
    ]
    return "\n".join(out), {"redis-round-trips: TTFT by turn of 4-turn conversations": ["redis-round-trips"]}


def _itl_table(by: dict[str, ConfigResult], checks: list[tuple[str, str, float, float, str]]) -> list[str]:
    """ITL at ``STREAMS`` paced streams: direct (pd-direct), through the bare P/D relay where it ran, and
    through turnkv; what turnkv adds over each."""
    d, t = by.get("itl-pd-direct"), by.get("itl-turnkv")
    if not (d and t):
        return []
    relay = by.get("itl-bare-pd-relay")
    rows, p99 = [], {}
    for x in (d, relay, t):
        if x is None:
            continue
        s = summarize(x.requests)
        itl = [v for r in x.requests if r.ok for v in r.itl_ms]
        use = f"{x.meta['gateway_cpu_s'] / x.wall_s:.0%}" if "gateway_cpu_s" in x.meta and x.wall_s else "-"
        p99[x.name] = s.itl_p99
        row = [s.itl_p50, percentile(itl, 90), s.itl_p99, s.ttft_p50]
        rows.append([x.name, s.n, s.errors, *(fmt_ms(v) for v in row), use])
    added = p99["itl-turnkv"] - p99["itl-pd-direct"]
    lines = [f"Added ITL p99: {added:+.2f} ms."]
    if relay is not None:
        over = p99["itl-turnkv"] - p99["itl-bare-pd-relay"]
        lines.append(f"ITL p99 through turnkv minus through the bare P/D relay: {over:+.2f} ms.")
    checks.append(("added ITL p99 <= 2 ms at 256 streams", "itl-turnkv", added, 2.0, "ms"))
    return [
        f"## ITL at {STREAMS} concurrent streams (ms)",
        "",
        md_table(["config", "streams", "errors", "ITL p50", "ITL p90", "ITL p99", "TTFT p50", "gateway CPU use"], rows),
        "",
        *lines,
        "",
    ]


def _cpu_ms(cfg: ConfigResult) -> float:
    return float(cfg.meta.get("gateway_cpu_s", math.nan)) * 1e3 / max(len(cfg.requests), 1)


def _ratio_table(configs: Sequence[ConfigResult], checks: list[tuple[str, str, float, float, str]]) -> list[str]:
    """turnkv's gateway CPU per request over the bare relay's at the same load (each against its own
    zero-cost engines, both pinned alone on CPU 1), and over the bare P/D relays' (the handshake alone, on
    aiohttp.web and on uvicorn)."""
    by = {c.name: c for c in configs}

    def cpu(name: str) -> float:
        cfg = by.get(name)
        return _cpu_ms(cfg) if cfg is not None and "gateway_cpu_s" in cfg.meta else math.nan

    def over(t: float, base: float) -> str:
        return "-" if _nan(base) else f"{t / base:.2f}x"

    rows = []
    for label, _ in LOADS:
        b, f, u = (cpu(f"{name}-{label}") for name in ("bare-relay", "bare-pd-relay", "bare-pd-relay-uvicorn"))
        if _nan(b) and _nan(u):
            continue
        for name, limit in RATIO_TARGETS:
            t = cpu(f"{name}-{label}")
            if _nan(t):
                continue
            target = f"{limit:g}x" if limit else "-"
            ms = ("-" if _nan(x) else f"{x:.3f}" for x in (b, f, u, t))
            rows.append([label, name, *ms, over(t, b), over(t, f), over(t, u), target])
            if limit and label == LOADS[-1][0] and not _nan(b):
                checks.append(
                    (f"gateway CPU/request vs bare relay <= {limit:g}x", f"{name}-{label}", t / b, limit, "x")
                )
    if not rows:
        return []
    return [
        "## Gateway CPU per request against the bare relay",
        "",
        "The bare relay (`turnkv.bench.baseline_relay`: aiohttp.web, forwards bytes without parsing) runs in "
        "front of one zero-cost engine, pinned to CPU 1 like the gateway; *ratio* = turnkv's CPU ms per "
        "request / the relay's at the same load. turnkv makes two engine calls per turn (P and D), the relay one. "
        "The bare P/D relay (the same with `--prefill`: vLLM's P/D handshake, orjson, no checks) makes turnkv's "
        "two: *over P/D relay* = turnkv's CPU ms / its. The uvicorn P/D relay is the same handshake as a bare "
        "ASGI app on uvicorn, turnkv's server stack (`--server uvicorn`): *over uvicorn P/D relay* is what "
        "turnkv's own code costs on that stack.",
        "",
        md_table(
            ["load", "config", "bare relay CPU ms", "bare P/D relay CPU ms", "uvicorn P/D relay CPU ms"]
            + ["turnkv CPU ms", "ratio", "over P/D relay", "over uvicorn P/D relay", "target"],
            rows,
        ),
        "",
    ]


def _long_table(by: dict[str, ConfigResult]) -> list[str]:
    """Later turns (2..4) of long conversations: what a long history costs per turn, outside the engines."""
    rows = []
    for h in HISTORIES:
        k = f"{h // 1000}k"
        got = {p: by.get(f"long-{p}-{k}") for p in ("colocated", "pd-direct", "turnkv")}
        later = {p: summarize([r for r in c.requests if r.turn > 1]) for p, c in got.items() if c is not None}
        if len(later) < 3:
            continue
        tk = got["turnkv"]
        assert tk is not None
        turns = len(tk.requests)
        cpu = tk.meta.get("gateway_cpu_s", math.nan) * 1e3 / max(turns, 1)
        rows.append(
            [
                k,
                fmt_ms(later["colocated"].ttft_p50),
                fmt_ms(later["pd-direct"].ttft_p50),
                fmt_ms(later["turnkv"].ttft_p50),
                later["turnkv"].actions_text(),
                f"{later['turnkv'].ttft_p50 - later['pd-direct'].ttft_p50:+.1f}",
                f"{later['turnkv'].ttft_p50 - later['colocated'].ttft_p50:+.1f}",
                f"{cpu:.1f}",
            ]
        )
    if not rows:
        return []
    return [
        "## Long histories: per-turn cost outside the engines' simulated compute (turns 2-4, ms)",
        "",
        "Zero-cost engines, one conversation at a time, so every millisecond here is real CPU and HTTP: "
        "JSON, chat rendering, tokenization, the token check, and the engines' own bookkeeping.",
        "",
        md_table(
            [
                "history",
                "colocated p50",
                "pd-direct p50",
                "turnkv p50",
                "turnkv actions",
                "turnkv - pd-direct",
                "turnkv - colocated",
                "gateway CPU ms per turn",
            ],
            rows,
        ),
        "",
    ]


def plot(configs: Sequence[ConfigResult], path: Path) -> None:
    """TTFT p50 (solid) and p99 (dashed) against load, one line per way of reaching the engines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    prefixes = ("direct-colocated", "pd-direct", "turnkv-stateless", "turnkv-session", "turnkv-redis")
    by = {c.name: c for c in configs}
    labels = [label for label, _ in LOADS]
    for i, prefix in enumerate(prefixes):
        pts = [
            (x, summarize(by[f"{prefix}-{lab}"].requests)) for x, lab in enumerate(labels) if f"{prefix}-{lab}" in by
        ]
        if not pts:
            continue
        xs = [x for x, _ in pts]
        ax.plot(xs, [s.ttft_p50 for _, s in pts], "o-", color=f"C{i}", label=prefix, ms=3)
        ax.plot(xs, [s.ttft_p99 for _, s in pts], "--", color=f"C{i}", lw=0.8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yscale("log")
    ax.set_xlabel("load (c = concurrent requests, r = requests/s)")
    ax.set_ylabel("TTFT ms (p50 solid, p99 dashed)")
    ax.set_title("Zero-cost engines: TTFT direct vs through turnkv", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
