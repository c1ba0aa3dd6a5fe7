"""Markdown tables and the TTFT-by-turn PNG for any run; the scenarios add their own comparisons."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from turnkv.bench.records import ConfigResult, RunResult
from turnkv.bench.stats import by_turn, fmt_ms


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(x: object) -> str:
        return str(x).replace("|", "\\|")

    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def per_turn_table(configs: Sequence[ConfigResult]) -> str:
    """TTFT p50/p90/p99 per turn for each configuration, with errors and turnkv's decisions."""
    rows: list[list[object]] = []
    for c in configs:
        for s in by_turn(c.requests):
            rows.append(
                [
                    c.name,
                    s.turn,
                    s.n,
                    s.errors,
                    fmt_ms(s.ttft_p50),
                    fmt_ms(s.ttft_p90),
                    fmt_ms(s.ttft_p99),
                    fmt_ms(s.itl_p99),
                    s.actions_text(),
                ]
            )
    return md_table(
        [
            "config",
            "turn",
            "n",
            "errors",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "TTFT p99 ms",
            "ITL p99 ms",
            "turnkv action (count)",
        ],
        rows,
    )


def markdown(run: RunResult, title: str = "turnkv bench") -> str:
    m = run.machine
    parts = [
        f"# {title}",
        "",
        f"- command: `{run.command}`",
        f"- created: {run.created}; machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), Python {m.get('python')}",
        "- times are client-side wall-clock milliseconds; TTFT is from sending the request to the first SSE "
        "event carrying generated text",
        "",
    ]
    for c in run.configs:
        parts += [
            f"- **{c.name}**: {c.description} (target: {c.target.get('kind')}; {len(c.requests)} requests "
            f"in {c.wall_s:.1f} s)"
        ]
    parts += ["", "## TTFT per turn", "", per_turn_table(run.configs), ""]
    return "\n".join(parts)


def plot_ttft_by_turn(
    configs: Sequence[ConfigResult],
    path: Path,
    *,
    title: str = "TTFT by turn",
    groups: dict[str, list[str]] | None = None,
    dpi: int = 80,
) -> None:
    """One panel per group (all configurations in one panel by default): p50 lines, p90 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    by_name = {c.name: c for c in configs}
    groups = groups or {"": [c.name for c in configs]}
    n = len(groups)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (gname, names) in zip(axes.flat, groups.items(), strict=False):
        for i, name in enumerate(names):
            c = by_name.get(name)
            if c is None:
                continue
            st = [s for s in by_turn(c.requests) if not math.isnan(s.ttft_p50)]
            if not st:
                continue
            turns = [s.turn for s in st]
            color = f"C{i % 10}"
            ax.plot(turns, [s.ttft_p50 for s in st], "o-", color=color, label=name, lw=1.4, ms=3)
            ax.plot(turns, [s.ttft_p90 for s in st], "--", color=color, lw=0.8)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT ms (p50 solid, p90 dashed)")
        if gname:
            ax.set_title(gname, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_outputs(
    run: RunResult, out: Path, *, title: str, extra_markdown: str = "", groups: dict[str, list[str]] | None = None
) -> None:
    """A run's results.json, report.md and TTFT plot under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    run.write(out / "results.json")
    (out / "report.md").write_text(markdown(run, title) + ("\n" + extra_markdown if extra_markdown else ""))
    plot_ttft_by_turn(run.configs, out / "ttft_by_turn.png", title=title, groups=groups)
