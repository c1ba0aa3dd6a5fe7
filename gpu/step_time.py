#!/usr/bin/env python3
"""Decode step time of real vLLM against the prefill tokens in the batch and the batch size (H200).

What the simulator's step model (``src/turnkv/sim/costs.py``) needs measured: the inter-token latency
streams see while an engine decodes ``B`` of them at a context of ``C`` tokens, and how much longer the
step is when a prefill of ``P`` tokens is scheduled beside them (vLLM's chunked prefill: the decode
tokens and the prefill chunk share ``max_num_batched_tokens``; a longer prefill is split over steps).

One engine (gpu/make_model.py's 8b model, dummy weights: the Qwen3-8B shape; NIXL connector as on a decode engine;
prefix caching on; ``--max-num-batched-tokens 8192``), alone on the GPU. Per group (B, C):

1. B streams start (prompts of C one-token words each, unique, ``ignore_eos``, long answers); the script
   waits until every one streams, then records each stream's token arrival times (its ITL);
2. a quiet second: the decode-only step time;
3. injections, one at a time, 0.3 s apart: for each P, a fresh prompt of P tokens (``max_tokens: 1``),
   and P tokens over a cached prefix of C tokens (the prefix is sent first; that send is itself a fresh
   injection of C tokens): the shape of a decode-local turn. Each injection's send and end times are
   kept, so the steps that carried its chunks are the token gaps inside that window;
4. the streams are closed (vLLM aborts them).

Writes ``OUT/step_time.json`` (raw: every stream's token times, every injection's window); fit the
simulator's constants from it with ``gpu/fit_step_time.py OUT/step_time.json``. A time budget stops
starting groups (engine start included), so a run stays within its call: the default grid takes about
four minutes of device time after a one-to-two-minute engine start.

Device call (nothing else on the GPU; about 6 minutes; the lead runs it):
    python3 gpu/step_time.py --time-budget-s 300

Here, against the simulator (its step model is what the fit should find again):
    TURNKV_GPU_BACKEND=sim python3 gpu/step_time.py --batches 1,8 --contexts 1024 --prefills 512,2048
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devlib

PORT, SIDE_PORT = 8150, 5650
M = devlib.MODEL_NAME
WARM_TOKENS = 20  # every stream has streamed this many tokens before a group is measured
STREAM_WAIT_S = 120.0  # for the streams to start (their prefill: B x C tokens)


@dataclass
class Stream:
    """One long streamed answer, read in its own thread; ``times`` are perf_counter seconds per token."""

    url: str
    body: dict[str, Any]
    times: list[float] = field(default_factory=list)
    error: str | None = None
    conn: http.client.HTTPConnection | None = None
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        hostport = self.url[len("http://") :]
        try:
            self.conn = http.client.HTTPConnection(hostport, timeout=devlib.HTTP_TIMEOUT_S)
            self.conn.request(
                "POST", "/v1/completions", body=json.dumps(self.body), headers={"content-type": "application/json"}
            )
            resp = self.conn.getresponse()
            if resp.status != 200:
                self.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                return
            while True:
                line = resp.readline()
                if not line:
                    return
                if line.startswith(b"data: ") and b'"text"' in line:
                    self.times.append(time.perf_counter())
        except OSError as exc:  # closed by stop(), or the engine went away
            self.error = self.error or f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        if self.conn is not None:
            try:
                if self.conn.sock is not None:
                    self.conn.sock.shutdown(2)
            except OSError:
                pass
            self.conn.close()
        if self.thread is not None:
            self.thread.join(10)


def prompt(words: list[str], rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def complete(url: str, text: str, max_tokens: int = 1) -> tuple[float, float, int]:
    """One non-streamed completion: (sent, ended) perf_counter times and its HTTP status."""
    body = {"model": M, "prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    t0 = time.perf_counter()
    rep = devlib.post(url, "/v1/completions", body)
    return t0, time.perf_counter(), rep.status


def run_group(
    url: str, words: list[str], rng: random.Random, batch: int, context: int, prefills: list[int], reps: int
) -> dict[str, Any]:
    streams = [
        Stream(
            url,
            {
                "model": M,
                "prompt": prompt(words, rng, context),
                "max_tokens": 4000,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            },
        )
        for _ in range(batch)
    ]
    t_start = time.perf_counter()
    for s in streams:
        s.start()
    deadline = time.monotonic() + STREAM_WAIT_S
    while time.monotonic() < deadline and not all(len(s.times) >= WARM_TOKENS or s.error for s in streams):
        time.sleep(0.05)
    group: dict[str, Any] = {
        "batch": batch,
        "context": context,
        "started_s": round(time.perf_counter() - t_start, 2),
        "injections": [],
    }
    try:
        if not all(len(s.times) >= WARM_TOKENS for s in streams):
            group["error"] = "streams did not start: " + "; ".join(s.error or "slow" for s in streams)[:500]
            return group
        q0 = time.perf_counter()
        time.sleep(1.0)
        group["quiet"] = [q0, time.perf_counter()]
        for p in prefills:
            for rep in range(reps):
                sent, ended, status = complete(url, prompt(words, rng, p))
                group["injections"].append(
                    {"prefill": p, "over": 0, "rep": rep, "sent": sent, "ended": ended, "status": status}
                )
                time.sleep(0.3)
                # the same shape as a decode-local turn: P new tokens over a cached prefix of C tokens
                prefix = prompt(words, rng, context)
                sent, ended, status = complete(url, prefix)
                group["injections"].append(
                    {
                        "prefill": context,
                        "over": 0,
                        "rep": rep,
                        "sent": sent,
                        "ended": ended,
                        "status": status,
                        "warms_prefix": True,
                    }
                )
                time.sleep(0.3)
                sent, ended, status = complete(url, prefix + " " + prompt(words, rng, p))
                group["injections"].append(
                    {"prefill": p, "over": context, "rep": rep, "sent": sent, "ended": ended, "status": status}
                )
                time.sleep(0.3)
    finally:
        for s in streams:
            s.stop()
        group["streams"] = [{"times": s.times, "error": s.error} for s in streams]
    return group


def summary(group: dict[str, Any]) -> dict[str, Any]:
    """Median decode step in the quiet second, and per injection the longest step it overlapped (ms)."""
    gaps_in = []
    for st in group.get("streams", []):
        t = st["times"]
        gaps_in.append([(b, (b - a) * 1e3) for a, b in zip(t, t[1:], strict=False)])

    def median(xs: list[float]) -> float | None:
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else None

    q = group.get("quiet")
    quiet = median([g for gs in gaps_in for end, g in gs if q and q[0] <= end <= q[1]])
    out = {"batch": group["batch"], "context": group["context"], "quiet_itl_ms": quiet, "injections": []}
    for inj in group["injections"]:
        longest = [
            max((g for end, g in gs if inj["sent"] <= end <= inj["ended"] + 0.05), default=0.0) for gs in gaps_in
        ]
        out["injections"].append(
            {"prefill": inj["prefill"], "over": inj["over"], "step_ms": median([x for x in longest if x > 0])}
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64", help="decode batch sizes B")
    ap.add_argument("--contexts", default="1024,8192", help="tokens of context per stream C")
    ap.add_argument("--prefills", default="128,512,1024,2048,4096,8000", help="prefill tokens injected P")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--mem", type=float, default=0.85, help="--gpu-memory-utilization (alone on the GPU)")
    ap.add_argument("--size", default="8b", choices=["8b", "1b"])
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--sim-time-scale", type=float, default=1.0, help="simulator backend only")
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=300.0,
        help="start no group after this many seconds (engine start included)",
    )
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--keep", action="store_true", help="leave the engine running")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    spec = devlib.EngineSpec(
        "steptime",
        "colocated",
        a.port,
        SIDE_PORT,
        str(devlib.KIT / f"model-{a.size}-keep"),
        mem=a.mem,
        flags=["--enable-prefix-caching", "--max-num-batched-tokens", "8192"],
        max_model_len=20480,
    )
    rec = devlib.start_engine(spec, time_scale=a.sim_time_scale)
    pairs = devlib.words_for(spec.url, 3000)
    words = [w for w, _ in pairs]
    rng = random.Random(a.seed)
    prefills = [int(x) for x in a.prefills.split(",") if x]
    res: dict[str, Any] = {
        "backend": devlib.backend(),
        "args": vars(a),
        "engine": devlib.vllm_command(spec)[0],
        "engine_start_s": rec.get("start_s"),
        "max_num_batched_tokens": 8192,
        "sim_time_scale": a.sim_time_scale if devlib.backend() == "sim" else None,
        "groups": [],
        "skipped": [],
    }
    try:
        for c in (int(x) for x in a.contexts.split(",") if x):
            for b in (int(x) for x in a.batches.split(",") if x):
                if time.perf_counter() - t0 > a.time_budget_s:
                    res["skipped"].append({"batch": b, "context": c})
                    continue
                g = run_group(spec.url, words, rng, b, c, prefills, a.reps)
                res["groups"].append(g)
                s = summary(g)
                devlib.log(
                    f"B={b} C={c}: quiet ITL {s['quiet_itl_ms']} ms; with prefill "
                    + ", ".join(f"{i['prefill']}/{i['over']}: {i['step_ms']}" for i in s["injections"])
                )
                devlib.write_json(devlib.out_dir() / "step_time.json", res)
    finally:
        if not a.keep:
            devlib.stop(spec.name)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["summary"] = [summary(g) for g in res["groups"]]
    devlib.write_json(devlib.out_dir() / "step_time.json", res)
    print(
        json.dumps(
            {
                "seconds": res["seconds"],
                "skipped": res["skipped"],
                "quiet_itl_ms": {f"B{s['batch']} C{s['context']}": s["quiet_itl_ms"] for s in res["summary"]},
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
