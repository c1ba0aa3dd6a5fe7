"""The suites by name: which benches each runs, and how its report is analysed.

A suite runs its benches one at a time; results.json is rewritten after each, so a long run that
is stopped keeps what it measured. A bench whose processes fail to start is recorded and skipped.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from turnkv.bench.records import ConfigResult, RunResult
from turnkv.bench.scenarios import (
    decode_memory,
    decode_overload,
    fifth_turn,
    four_hop,
    goodput,
    overhead,
    reliability,
    render_ahead,
    shared_gpu,
    smoke,
)
from turnkv.bench.scenarios.base import Bench, run_bench, with_duration, with_gateway_workers

Analyzer = Callable[[Sequence[ConfigResult]], tuple[str, dict[str, list[str]]]]
SUITES: dict[str, tuple[Callable[[int | None], list[Bench]], Analyzer]] = {
    "fifth-turn": (fifth_turn.benches, fifth_turn.analyze),
    "four-hop": (four_hop.benches, four_hop.analyze),
    "overhead": (overhead.benches, overhead.analyze),
    "smoke": (smoke.benches, smoke.analyze),
    "decode-memory": (decode_memory.benches, decode_memory.analyze),
    "decode-overload": (decode_overload.benches, decode_overload.analyze),
    "goodput": (goodput.benches, goodput.analyze),
    "reliability": (reliability.benches, reliability.analyze),
    "render-ahead": (render_ahead.benches, render_ahead.analyze),
    "shared-gpu": (shared_gpu.benches, shared_gpu.analyze),
}
TITLES = {
    "fifth-turn": "turnkv bench: fifth-turn TTFT on the simulator",
    "four-hop": "turnkv bench: the fifth turn over four hops against two, on the simulator",
    "overhead": "turnkv bench: gateway overhead with zero-cost engines",
    "smoke": "turnkv bench: smoke",
    "decode-memory": "turnkv bench: decode memory under load",
    "decode-overload": "turnkv bench: more conversations than the decode engine holds",
    "goodput": "turnkv bench: goodput under SLOs, load sweeps on the simulator",
    "reliability": "turnkv bench: reliability, many concurrent streams for minutes",
    "render-ahead": "turnkv bench: pull turns with the render off the critical path, against vLLM's multi-turn proxy",
    "shared-gpu": "turnkv bench: agents at 64 conversations on one GPU that P and D share, two waves",
}


def analyze(run: RunResult) -> tuple[str, dict[str, list[str]]]:
    _, analyzer = SUITES.get(run.suite, (None, None))
    notes = ""
    if run.extra.get("failures"):
        notes = "## Failed benches\n\n" + "\n".join(f"- {f}" for f in run.extra["failures"]) + "\n\n"
    if analyzer is None:
        return notes, {}
    text, groups = analyzer(run.configs)
    return notes + text, groups


def write(run: RunResult, out: Path) -> None:
    from turnkv.bench.report import write_outputs

    text, groups = analyze(run)
    write_outputs(run, out, title=TITLES.get(run.suite, run.suite), extra_markdown=text, groups=groups)
    if run.suite == "reliability":
        reliability.plot(run.configs, out / "resources.png")
    if run.suite == "overhead":
        overhead.plot(run.configs, out / "ttft_by_load.png")
    if run.suite == "goodput":
        goodput.plot(run.configs, out / "goodput_vs_rate.png")
        goodput.write_summary(run, out / "summary.json")
    if run.suite == "fifth-turn":
        from turnkv.bench.report import plot_ttft_by_turn

        fifth_turn.plot_turn5(run.configs, out / "ttft5_by_config.png")
        grid = {g: names for g, names in groups.items() if g.startswith("16k ")}
        if grid:
            plot_ttft_by_turn(
                run.configs, out / "ttft_by_turn_16k.png", title="TTFT by turn, 16k history", groups=grid, dpi=60
            )


def _only(bench: Bench, only: list[str] | None) -> Bench:
    """The bench with just the plans whose name contains one of ``only`` (all of them without ``only``)."""
    if not only:
        return bench
    return replace(bench, plans=tuple(p for p in bench.plans if any(s in p.name for s in only)))


def run_suite(
    name: str,
    out: Path,
    *,
    only: list[str] | None = None,
    show_progress: bool = True,
    command: str = "",
    conversations: int | None = None,
    resume: bool = False,
    gateway_workers: int = 1,
    sweep: goodput.SweepOptions | None = None,
    duration_s: float | None = None,
) -> int:
    """Runs the suite's benches; with ``resume``, keeps the configurations already in ``out/results.json``
    and runs only the benches that have none there (a stopped run goes on where it stopped). With
    ``gateway_workers`` above 1 every gateway runs that many workers, with a Redis store; ``duration_s``
    replaces every load's duration. The goodput suite is a sweep (``sweep``): its benches come rate by
    rate, until it stops."""
    make, _ = SUITES[name]
    run = RunResult(suite=name, command=command)
    run.extra["failures"] = []
    if resume and (out / "results.json").exists():
        run = RunResult.read(out / "results.json")
        run.command += " ; " + command
        run.extra["failures"] = []
    done = {c.name for c in run.configs}
    source: Iterator[Bench] = (
        goodput.sweep(sweep or goodput.SweepOptions(), run.configs) if name == "goodput" else iter(make(conversations))
    )
    total = "" if name == "goodput" else f"/{len(make(conversations))}"
    logs = out / "logs"
    for i, bench in enumerate(source, 1):
        bench = _only(bench, only)
        if not bench.plans:
            continue
        if any(p.name in done for p in bench.plans):
            continue
        bench = with_duration(with_gateway_workers(bench, gateway_workers), duration_s)
        names = ", ".join(p.name for p in bench.plans)
        print(f"[{i}{total}] {names}", file=sys.stderr, flush=True)
        try:
            run.configs += run_bench(bench, logs, show_progress=show_progress)
        except Exception as exc:  # a bench that cannot start must not lose the others' results
            traceback.print_exc()
            run.extra["failures"].append(f"{names}: {type(exc).__name__}: {str(exc)[:500]}")
        run.write(out / "results.json")
    write(run, out)
    errors = sum(1 for c in run.configs for r in c.requests if not r.ok)
    print(
        f"{len(run.configs)} configurations, {errors} failed requests, {len(run.extra['failures'])} failed "
        f"benches; report in {out}/report.md",
        file=sys.stderr,
    )
    return 1 if run.extra["failures"] or errors else 0
