"""``turnkv bench``: ``run`` (load against any endpoint), ``scenarios`` (simulator suites) and ``report``."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from turnkv.bench.workload import WorkloadSpec

DEFAULT_OUT = Path("results")  # git ignores it


def _bool_flag(p: argparse._ActionsContainer, name: str, default: bool, help_: str) -> None:
    dest = name.replace("-", "_")
    p.add_argument(f"--{name}", dest=dest, action="store_true", default=default, help=help_)
    p.add_argument(f"--no-{name}", dest=dest, action="store_false")


def _workload_args(p: argparse.ArgumentParser) -> None:
    d = WorkloadSpec()
    g = p.add_argument_group("workload")
    g.add_argument("--conversations", type=int, default=d.conversations)
    g.add_argument("--turns", type=int, default=d.turns, help="user turns per conversation")
    g.add_argument("--system-tokens", type=int, default=d.system_tokens, help="system prompt length (history)")
    g.add_argument("--user-tokens", type=int, default=d.user_tokens, help="each user message")
    g.add_argument("--answer-tokens", type=int, default=d.answer_tokens, help="max_tokens with ignore_eos")
    g.add_argument("--think-time-s", type=float, default=d.think_time_s, help="mean of an exponential")
    g.add_argument("--rate", type=float, default=d.rate, help="new conversations per second (Poisson); 0: all at once")
    g.add_argument("--concurrency", type=int, default=d.concurrency, help="max active conversations")
    _bool_flag(g, "session-header", d.session_header, "send X-Session-ID")
    g.add_argument("--model", default=d.model)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--duration", type=float, default=d.duration_s, help="seconds after which no request starts")
    g.add_argument("--max-requests", type=int, default=d.max_requests)
    g.add_argument("--request-timeout", type=float, default=d.request_timeout_s)


def workload_from_args(a: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        conversations=a.conversations,
        turns=a.turns,
        system_tokens=a.system_tokens,
        user_tokens=a.user_tokens,
        answer_tokens=a.answer_tokens,
        think_time_s=a.think_time_s,
        rate=a.rate,
        concurrency=a.concurrency,
        session_header=a.session_header,
        model=a.model,
        seed=a.seed,
        duration_s=a.duration,
        max_requests=a.max_requests,
        request_timeout_s=a.request_timeout,
    )


def _command() -> str:
    return (
        "turnkv " + shlex.join(sys.argv[1:])
        if sys.argv and sys.argv[0].endswith("turnkv")
        else ("turnkv " + shlex.join(sys.argv[sys.argv.index("bench") :]) if "bench" in sys.argv else "turnkv bench")
    )


def _out_dir(a: argparse.Namespace, what: str) -> Path:
    return Path(a.out) if a.out else DEFAULT_OUT / f"{what}-{time.strftime('%Y%m%d-%H%M%S')}"


def _run(a: argparse.Namespace) -> int:
    from turnkv.bench.client import Target
    from turnkv.bench.records import ConfigResult, RunResult
    from turnkv.bench.report import write_outputs
    from turnkv.bench.runner import run_load

    if a.prefill_url and not a.decode_url:
        print("turnkv bench run: --prefill-url needs --decode-url", file=sys.stderr)
        return 2
    try:
        target = Target(url=a.url) if a.url else Target(prefill=a.prefill_url, decode=a.decode_url)
        spec = workload_from_args(a)
    except ValueError as exc:
        print(f"turnkv bench run: {exc}", file=sys.stderr)
        return 2
    out = _out_dir(a, "run")
    t0 = time.perf_counter()
    records = asyncio.run(run_load(spec, target, label=a.name, show_progress=a.progress))
    wall = time.perf_counter() - t0
    run = RunResult(suite="run", command=_command())
    run.configs.append(
        ConfigResult(
            name=a.name,
            group="",
            description=a.description or f"load against {target.kind}",
            workload=spec.to_dict(),
            target=target.to_dict(),
            requests=records,
            wall_s=wall,
        )
    )
    write_outputs(run, out, title="turnkv bench run")
    errors = sum(1 for r in records if not r.ok)
    print(f"{len(records)} requests, {errors} errors; results in {out}", file=sys.stderr)
    return 1 if errors and a.fail_on_error else 0


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError("rates must be positive")
    return rates


def _sweep_options(a: argparse.Namespace) -> Any:
    from turnkv.bench.goodput import Slo
    from turnkv.bench.scenarios.goodput import TOPOLOGIES, SweepOptions

    return SweepOptions(
        topologies=tuple(a.topology or TOPOLOGIES),
        rates=a.rates,
        slo=Slo(ttft_ms=a.slo_ttft_ms, tpot_ms=a.slo_tpot_ms),
        window_s=a.window_s,
        min_conversations=a.conversations or SweepOptions.min_conversations,
        max_conversations=a.max_conversations,
        past_collapse=a.past_collapse,
        budget_s=a.max_minutes * 60,
        time_scale=a.time_scale,
        **({"configs": tuple(a.configs.split(","))} if a.configs else {}),
    )


def _scenarios(a: argparse.Namespace) -> int:
    from turnkv.bench.scenarios.suites import run_suite

    try:
        sweep = _sweep_options(a) if a.suite == "goodput" else None
    except ValueError as exc:
        print(f"turnkv bench scenarios: {exc}", file=sys.stderr)
        return 2
    return run_suite(
        a.suite,
        _out_dir(a, a.suite),
        only=a.only,
        show_progress=a.progress,
        command=_command(),
        conversations=a.conversations,
        resume=a.resume,
        gateway_workers=a.gateway_workers,
        sweep=sweep,
        duration_s=a.duration,
    )


def _report(a: argparse.Namespace) -> int:
    from turnkv.bench.records import RunResult
    from turnkv.bench.scenarios.suites import write

    runs = [RunResult.read(Path(p)) for p in a.inputs]
    run = runs[0]
    for r in runs[1:]:
        run.configs += r.configs
        run.extra.setdefault("failures", []).extend(r.extra.get("failures", []))
        run.command += " ; " + r.command
    out = Path(a.out)
    write(run, out)
    print(f"report in {out}", file=sys.stderr)
    return 0


def _profile(a: argparse.Namespace) -> int:
    from turnkv.bench.profile import profile_gateway

    text = profile_gateway(
        _out_dir(a, "profile"), requests=a.requests, concurrency=a.concurrency, session=a.session, redis=a.redis
    )
    print(text[:4000])
    return 0


def add_bench_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("bench", help="multi-turn benchmark (see BENCHMARKS.md)")
    bsub = p.add_subparsers(dest="bench_command", required=True)

    r = bsub.add_parser("run", help="open-loop multi-turn load against an OpenAI-compatible endpoint")
    tgt = r.add_mutually_exclusive_group(required=True)
    tgt.add_argument("--url", help="base URL of turnkv or of an engine (http://host:port)")
    tgt.add_argument("--prefill-url", help="pd-direct: the client runs the P/D handshake itself (needs --decode-url)")
    r.add_argument("--decode-url")
    r.add_argument("--name", default="run", help="configuration name in the report")
    r.add_argument("--description", default="")
    r.add_argument("--out", default=None, help="output directory (default results/run-<time>)")
    _bool_flag(r, "progress", True, "progress line on stderr")
    r.add_argument("--fail-on-error", action="store_true", help="exit 1 when a request failed")
    _workload_args(r)
    r.set_defaults(func=_run)

    s = bsub.add_parser("scenarios", help="start simulated deployments and run a benchmark suite")
    s.add_argument(
        "--suite",
        required=True,
        choices=[
            "fifth-turn",
            "four-hop",
            "overhead",
            "smoke",
            "decode-memory",
            "decode-overload",
            "goodput",
            "reliability",
            "render-ahead",
            "shared-gpu",
        ],
    )
    s.add_argument("--out", default=None, help="output directory (default results/<suite>-<time>)")
    s.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="SUBSTRING",
        help="run only configurations whose name contains this (repeatable)",
    )
    s.add_argument(
        "--conversations",
        type=int,
        default=None,
        help="override the suite's conversations per config (reliability: conversations active at once)",
    )
    s.add_argument(
        "--duration", type=float, default=None, help="override every load's duration (s): no request starts after it"
    )
    s.add_argument("--resume", action="store_true", help="keep the configurations already in OUT/results.json")
    s.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        metavar="N",
        help="run each gateway as N workers (turnkv serve --workers N, with Redis; pinned to CPUs 1..N)",
    )
    _bool_flag(s, "progress", True, "progress line on stderr")
    g = s.add_argument_group("goodput sweep (--suite goodput; rates and times are simulated)")
    g.add_argument(
        "--topology",
        action="append",
        choices=["1p1d", "2p2d"],
        default=None,
        help="P/D topology to sweep (repeatable; default both)",
    )
    g.add_argument(
        "--rates",
        type=_rates,
        default=None,
        metavar="R1,R2,...",
        help="conversations arriving per second on 1P1D (2P2D: twice these); default 0.5,1,1.5,2,2.5,3,4",
    )
    g.add_argument(
        "--configs",
        default=None,
        metavar="C1,C2,...",
        help="configurations to run (default: colocated,plain,vllm-multiturn,adaptive,adaptive-no-itl,adaptive-pull; "
        "adaptive-before and adaptive-first on request: adaptive without the charge for P's queue, and with "
        "first turns on D while P is busy)",
    )
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=30.0)
    g.add_argument("--window-s", type=float, default=16.0, help="seconds of arrivals per rate")
    g.add_argument("--max-conversations", type=int, default=None, help="cap on conversations per rate")
    g.add_argument(
        "--past-collapse", type=int, default=2, help="rates to run after the first where colocated's ITL p99 collapsed"
    )
    g.add_argument("--max-minutes", type=float, default=15.0, help="per topology: no new rate starts after it")
    g.add_argument("--time-scale", type=float, default=1.0, help="the simulated engines' --time-scale")
    s.set_defaults(func=_scenarios)

    pr = bsub.add_parser("profile", help="cProfile of the gateway under zero-cost engines")
    pr.add_argument("--out", default=None, help="output directory (default results/profile-<time>)")
    pr.add_argument("--requests", type=int, default=600)
    pr.add_argument("--concurrency", type=int, default=8)
    pr.add_argument("--session", action="store_true", help="send X-Session-ID")
    pr.add_argument("--redis", action="store_true", help="a redis-server of its own as the store (implies --session)")
    pr.set_defaults(func=_profile)

    rep = bsub.add_parser("report", help="rebuild the report from results.json files (merged in order)")
    rep.add_argument("inputs", nargs="+")
    rep.add_argument("--out", required=True)
    rep.set_defaults(func=_report)

    _render_layer_parser(bsub)


def _render_layer_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("render-layer", help="the render layer's cost on the simulator")
    p.add_argument("what", choices=["derender", "capacity"])
    p.add_argument("--compat", choices=["0.26", "0.33"], default="0.33")
    p.add_argument("--prompt-tokens", type=int, default=9000)
    p.add_argument("--output-tokens", type=int, default=1600)
    p.add_argument("--itl-ms", type=float, default=8.0, help="D's inter-token latency as the stream is replayed")
    p.add_argument("--prompts", type=int, nargs="+", default=[2000, 9000, 30000])
    p.add_argument("--rates", type=float, nargs="+", default=[10, 50, 100], help="request rates to size for")
    p.add_argument("--utilisation", type=float, default=0.7, help="the busy share a render core is sized for")
    p.add_argument("--out", default="results/render-layer")
    p.set_defaults(func=_render_layer)


def _render_layer(a: argparse.Namespace) -> int:
    from turnkv.bench import render_layer

    return render_layer.run(a)
