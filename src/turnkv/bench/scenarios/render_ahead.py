"""The render-ahead suite: TTFT of pull turns (2 to 5) with the render off and on the critical path, against
vLLM's multi-turn proxy on the same engine path.

Decides the matrix (2k, 16k and 32k-token histories on every link preset, P's prefix cache off, so that
every later turn pulls D's KV) and the configurations per cell, run one after another in one process:
``vllm-multiturn`` (vLLM's multi-turn proxy as a policy: the previous handle pulled with the messages,
nothing rendered, nothing checked), ``always-pull`` as shipped (``ahead``: the record proves the history,
P gets the messages at once and returns the prompt ids it computed from, the token check runs on them and
gates D: ``gateway/turn/ahead.py``) and ``always-pull`` with ``TURNKV_AHEAD_CHECK=render`` (``beside``: the
check runs on a render call sent beside P's leg, as in run 1, where the render-first path, measured there,
was the "before"). TTFT of turns 2-5 together is compared: pulled turns are the ones the render delayed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from turnkv.bench.records import ConfigResult
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment
from turnkv.bench.scenarios.fifth_turn import DECODE_LINK, ENGINE, LINKS, WORKLOAD
from turnkv.bench.stats import fmt_ms, fmt_ratio, summarize

HISTORIES = (2000, 16000, 32000)
CONFIGS = ("vllm-multiturn", "beside", "ahead")  # the baseline, before, after
TARGET = 1.02  # the target: pull turns within 1.02x vLLM's multi-turn proxy
_POLICY = {"vllm-multiturn": "vllm-multiturn", "ahead": "always-pull", "beside": "always-pull"}
# every configuration pulls D's handle on every later turn: none writes it back to P instead (vLLM's proxy
# keeps every handle until the next turn takes it, and the other two are measured against it)
_NO_WRITE_BACK = ("TURNKV_WRITE_BACK__MODE", "off")
_ENV = {"beside": (("TURNKV_AHEAD_CHECK", "render"),)}


def _conversations(history: int, link: str, conversations: int | None) -> int:
    if conversations:
        return conversations
    if link == "host":  # 0.43 GB/s: a 16k pull takes ~5 s, a 32k one ~10 s
        return 2 if history >= 16000 else 4
    return 6


def _bench(history: int, link: str, config: str, conversations: int | None) -> Bench:
    k = f"{history // 1000}k"
    name = f"{k}-{link}-{config}"
    wl = replace(WORKLOAD, system_tokens=history, conversations=_conversations(history, link, conversations))
    d_link = DECODE_LINK.get(link)
    dep = Deployment(
        "pd",
        engine_flags=(*ENGINE, "--link", link),
        prefill_flags=("--no-prefix-caching",),
        decode_flags=("--link", d_link) if d_link else (),
        gateway_flags=("--policy", _POLICY[config]),
        gateway_env=(*_ENV.get(config, ()), _NO_WRITE_BACK),
    )
    what = {
        "vllm-multiturn": "turnkv --policy vllm-multiturn (vLLM's multi-turn proxy: no render, no check)",
        "ahead": "turnkv --policy always-pull, P sent the messages at once, checked on the ids P returns",
        "beside": "turnkv --policy always-pull, P sent the messages at once, TURNKV_AHEAD_CHECK=render "
        "(checked on a render call beside P's leg)",
    }[config]
    desc = f"1P1D, {link} link, P prefix cache off, {what}"
    tags = {"history": history, "link": link, "config": config}
    return Bench(dep, (ConfigPlan(name, f"{k} {link}", desc, wl, tags),))


def benches(conversations: int | None = None) -> list[Bench]:
    return [_bench(h, link, c, conversations) for h in HISTORIES for link in LINKS for c in CONFIGS]


def _later(c: ConfigResult) -> tuple[float, float, int, str]:
    s = summarize(r for r in c.requests if r.turn >= 2)
    return s.ttft_p50, s.ttft_p90, s.n, s.actions_text()


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    cells: dict[tuple[int, str], dict[str, tuple[float, float, int, str]]] = {}
    groups: dict[str, list[str]] = {}
    for c in configs:
        t = c.meta.get("tags", {})
        if "config" not in t:
            continue
        cells.setdefault((t["history"], t["link"]), {})[t["config"]] = _later(c)
        groups.setdefault(c.group, []).append(c.name)
    nan = (math.nan, math.nan, 0, "-")
    rows = []
    for (hist, link), by in sorted(cells.items(), key=lambda kv: (kv[0][0], LINKS.index(kv[0][1]))):
        v, r, a = (by.get(x, nan) for x in CONFIGS)
        after, before = _ratio(a[0], v[0]), _ratio(r[0], v[0])
        rows.append(
            [
                f"{hist // 1000}k",
                link,
                *(f"{fmt_ms(x[0])} / {fmt_ms(x[1])}" for x in (v, r, a)),
                fmt_ratio(before),
                fmt_ratio(after),
                "-" if math.isnan(after) else ("met" if after <= TARGET else "MISSED"),
                f"{a[2]}: {a[3]}",
            ]
        )
    text = "\n".join(
        [
            "## TTFT of turns 2-5 (ms, p50 / p90), pull turns, P's cache off",
            "",
            "*beside*: always-pull, the messages sent to P at once, checked on a render call beside P's leg "
            "(TURNKV_AHEAD_CHECK=render); *ahead*: always-pull, the messages sent to P at once, checked on the "
            f"prompt ids P returns. Ratios use p50 against vllm-multiturn; target <= {TARGET:.2f}x.",
            "",
            md_table(
                [
                    "history",
                    "link",
                    "vllm-multiturn",
                    "beside (before)",
                    "ahead (after)",
                    "before / vllm-multiturn",
                    "after / vllm-multiturn",
                    "target",
                    "ahead: turns, actions",
                ],
                rows,
            ),
            "",
        ]
    )
    return text, groups
