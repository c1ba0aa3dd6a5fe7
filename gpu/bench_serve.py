#!/usr/bin/env python3
"""Single-turn goodput with vLLM's own client: ``vllm bench serve`` through turnkv and through plain P/D.

The seed's command: the random dataset, 8k-token prompts, 256-token answers with ``--ignore-eos``, goodput
``ttft:2000 tpot:30``, and prefix caching off on every engine (``--no-enable-prefix-caching``: random prompts
share nothing, and a cache would only measure the dataset). Engines: gpu/engines.py ``pair8b`` with that flag
(P :8100, D :8200, 0.42 of the GPU each), started (or found running so). Two gateways side by side: ``turnkv``
at its defaults (each request a conversation's first turn, found from its history: what turnkv adds to a
single-turn request is its hop and its bookkeeping), and ``plain`` (the same gateway with
``conversation_from_history: false``). Per rate (``--rates``, lowest first), both modes one after the other,
``--seconds`` of arrivals each (``--num-prompts`` = rate x seconds); a rate starts only if both fit the time
budget. Written to OUT/bench_serve.json after every run: per rate and mode, vLLM's result (request and
output throughput, goodput, TTFT/TPOT/ITL percentiles), and turnkv's goodput over plain's.

Where ``vllm`` is not installed (the simulator) it writes the reason and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devlib
import engines

PORTS = {"turnkv": 8902, "plain": 8903}
KEYS = (
    "completed",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "p99_itl_ms",
)


def out_dir() -> Path:
    import os

    d = Path(os.environ.get("OUT") or devlib.ROOT / "results" / "gpu")
    d.mkdir(parents=True, exist_ok=True)
    return d


def write(res: dict[str, Any]) -> Path:
    path = out_dir() / "bench_serve.json"
    path.write_text(json.dumps(res, indent=1))
    return path


def settings(mode: str) -> dict[str, Any]:
    s: dict[str, Any] = {"health_interval_s": 1.0, "scrape_interval_s": 1.0}
    if mode == "plain":
        s["conversation_from_history"] = False
    return s


def bench(a: argparse.Namespace, url: str, mode: str, rate: float, budget_s: float) -> dict[str, Any]:
    """One ``vllm bench serve`` run; vLLM's result file's figures (or why there are none)."""
    name = f"bench_serve_{mode}_r{rate:g}.json"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        devlib.MODEL_NAME,
        "--tokenizer",
        a.tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--ignore-eos",
        "--request-rate",
        f"{rate:g}",
        "--num-prompts",
        str(max(1, round(rate * a.seconds))),
        "--goodput",
        f"ttft:{a.slo_ttft_ms:g}",
        f"tpot:{a.slo_tpot_ms:g}",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--seed",
        str(a.seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir()),
        "--result-filename",
        name,
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, budget_s))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {budget_s:.0f} s", "command": cmd}
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1), "command": cmd}
    if proc.returncode != 0:
        out["error"] = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
        return out
    doc = json.loads((out_dir() / name).read_text())
    out.update({k: doc.get(k) for k in KEYS})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1,2,3,4", help="requests per second, comma-separated, lowest first")
    ap.add_argument("--modes", default="turnkv,plain")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals per run")
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="8b", choices=["8b", "1b"])
    ap.add_argument("--ucx", action="append", default=[], metavar="NAME=VALUE", help="environment for both engines")
    ap.add_argument("--time-budget-s", type=float, default=470.0, help="nothing starts past this, engines included")
    a = ap.parse_args(argv)
    end = time.perf_counter() + a.time_budget_s
    res: dict[str, Any] = {"args": vars(a), "runs": [], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if devlib.backend() != "vllm" or importlib.util.find_spec("vllm") is None:
        res["skipped"] = "vllm is not installed here: vllm bench serve needs it"
        print(f"bench_serve: {res['skipped']}; {write(res)}")
        return 0
    a.tokenizer = str(devlib.KIT / f"model-{a.size}-keep")
    no_cache = ["--no-enable-prefix-caching"]
    env = dict(kv.split("=", 1) for kv in a.ucx)
    specs = engines.pair(a.size, p_flags=no_cache, d_flags=no_cache, env=env)
    res["engine_start_s"] = {s.name: devlib.start_engine(s).get("start_s") for s in specs}
    res["engines"] = {s.name: devlib.vllm_command(s)[0] for s in specs}
    p, d = specs[0].url, specs[1].url
    modes = [m for m in a.modes.split(",") if m]
    rates = sorted(float(r) for r in a.rates.split(",") if r)
    with contextlib.ExitStack() as stack:
        urls = {
            m: stack.enter_context(
                devlib.gateway(f"gw-bench-{m}", PORTS[m], [p], [d], policy="adaptive", settings=settings(m))
            )
            for m in modes
        }
        for rate in rates:
            per_run = a.seconds * 1.5 + 30  # arrivals, the tail of the last answers, the client's start
            if time.perf_counter() + per_run * len(modes) > end:
                res.setdefault("skipped_rates", []).append(rate)
                continue
            row: dict[str, Any] = {"rate": rate}
            for m in modes:
                row[m] = bench(a, urls[m], m, rate, end - time.perf_counter())
                devlib.log(f"bench_serve rate {rate:g} {m}: {json.dumps({k: row[m].get(k) for k in KEYS})}")
            t, pl = row.get("turnkv", {}), row.get("plain", {})
            if t.get("request_goodput") is not None and pl.get("request_goodput"):
                row["goodput_turnkv_over_plain"] = round(t["request_goodput"] / pl["request_goodput"], 3)
            res["runs"].append(row)
            write(res)
    print(f"bench_serve: {len(res['runs'])} rates; {write(res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
