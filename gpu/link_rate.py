#!/usr/bin/env python3
"""How fast NIXL moves KV between P and D on this host, under UCX/NIXL/vLLM settings that might raise it.

The H200 host measured about 0.45 GB/s: UCX ends up on TCP for same-GPU reads (vllm#52607: ``cuda_ipc`` does
not serve GET without NVLink; UCX disables cuda_ipc ``get_zcopy`` then, openucx/ucx#7566), and
``UCX_TLS=cuda_ipc,cuda_copy,tcp,self`` changed nothing while dropping tcp failed ("no active messages
transport"). Each variant below restarts P and D with its settings (both sides need them), then
measures both directions on one long conversation, twice:

* P -> D: D reads P's KV for a fresh ``--tokens``-token prompt (standard P/D, measured on D's /metrics);
* D -> P: P (no prefix cache) reads the same blocks back from D with D's handle (measured on P's).

Variants (in the order of how likely they are to help; pick with ``--variants``):
  baseline             nothing set (UCX chooses; UCX_LOG_LEVEL=info in all variants logs the lanes)
  get_zcopy            UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: let cuda_ipc serve GET without NVLink
  get_zcopy_sm         ... and UCX_TLS=cuda_ipc,cuda_copy,sm,self (shared memory provides the active
                       messages tcp provided)
  get_zcopy_no_emul    ... and UCX_PROTO_EMULATION_ENABLE=n (no RMA emulated over active messages)
  tcp_segments         UCX_TCP_TX_SEG_SIZE=8M UCX_TCP_RX_SEG_SIZE=8M UCX_TCP_SNDBUF=8M UCX_TCP_RCVBUF=8M
  cross_layers         one descriptor per block for all layers (kv_connector_extra_config
                       enable_cross_layers_blocks, needs VLLM_KV_CACHE_LAYOUT=HND)
  block64              --block-size 64: 4x larger, 4x fewer descriptors
  threads16            kv_connector_extra_config num_threads=16 (default 4)
Unknown UCX variables only produce a UCX warning. A variant whose engines do not start is recorded
with the end of its logs and the next one runs.

Writes OUT/link_rate.json (rates, and the engines' UCX lane and "KV Transfer metrics" lines).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devlib
import engines

M = devlib.MODEL_NAME
P_ONLY = devlib.P_ONLY
GET_ZCOPY = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "get_zcopy": {"env": GET_ZCOPY},
    "get_zcopy_sm": {"env": {**GET_ZCOPY, "UCX_TLS": "cuda_ipc,cuda_copy,sm,self"}},
    "get_zcopy_no_emul": {"env": {**GET_ZCOPY, "UCX_PROTO_EMULATION_ENABLE": "n"}},
    "tcp_segments": {
        "env": {
            "UCX_TCP_TX_SEG_SIZE": "8M",
            "UCX_TCP_RX_SEG_SIZE": "8M",
            "UCX_TCP_SNDBUF": "8M",
            "UCX_TCP_RCVBUF": "8M",
        }
    },
    "cross_layers": {"env": {"VLLM_KV_CACHE_LAYOUT": "HND"}, "kv_extra": {"enable_cross_layers_blocks": "True"}},
    "block64": {"flags": ["--block-size", "64"]},
    "threads16": {"kv_extra": {"num_threads": 16}},
}
LANE = re.compile(r"(intra-node cfg.*|KV Transfer metrics: .*|UCX +(WARN|ERROR).*|no active messages.*)")


def measure(p: str, d: str, words: list[str], allowed: list[int], rng: random.Random, tokens: int) -> dict[str, Any]:
    msgs = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(tokens))}]
    body = {
        "model": M,
        "messages": msgs,
        "max_tokens": 16,
        "ignore_eos": True,
        "temperature": 0,
        "allowed_token_ids": allowed,
    }
    t0 = time.perf_counter()
    prep = devlib.post(p, "/v1/chat/completions", {**body, "max_tokens": 1, "kv_transfer_params": P_ONLY})
    if prep.status != 200:
        return {"error": f"P: {prep.status} {prep.raw[:300]}"}
    before_d = devlib.metrics(d)
    t1 = time.perf_counter()
    dec = devlib.post(d, "/v1/chat/completions", {**body, "kv_transfer_params": prep.json["kv_transfer_params"]})
    p_to_d = {**devlib.nixl_delta(before_d, devlib.metrics(d)), "request_s": round(time.perf_counter() - t1, 3)}
    if dec.status != 200 or not isinstance((dec.json or {}).get("kv_transfer_params"), dict):
        return {"error": f"D: {dec.status} {dec.raw[:300]}", "p_to_d": p_to_d}
    answer = dec.json["choices"][0]["message"]["content"] or ""
    msgs2 = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "again"}]
    before_p = devlib.metrics(p)
    t2 = time.perf_counter()
    back = devlib.post(
        p,
        "/v1/chat/completions",
        {**body, "messages": msgs2, "max_tokens": 1, "kv_transfer_params": dec.json["kv_transfer_params"]},
    )
    d_to_p = {
        **devlib.nixl_delta(before_p, devlib.metrics(p)),
        "request_s": round(time.perf_counter() - t2, 3),
        "status": back.status,
    }
    return {
        "prompt_tokens": (dec.json.get("usage") or {}).get("prompt_tokens"),
        "p_to_d": p_to_d,
        "d_to_p": d_to_p,
        "total_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="baseline,get_zcopy,get_zcopy_sm")
    ap.add_argument("--size", default="1b", choices=["1b", "8b"])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--pulls", type=int, default=2)
    ap.add_argument("--mem", type=float, default=0.3)
    ap.add_argument("--time-budget-s", type=float, default=480.0, help="start no variant after this")
    ap.add_argument("--keep-running", action="store_true", help="leave the last variant's engines up")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = devlib.out_dir() / "link_rate.json"
    res: dict[str, Any] = {"backend": devlib.backend(), "args": vars(a), "variants": {}}
    if out.exists():  # several calls add to one file
        res["variants"] = json.loads(out.read_text()).get("variants", {})
    rng = random.Random(5)
    names = [v for v in a.variants.split(",") if v]
    for i, name in enumerate(names):
        if time.perf_counter() - t_start > a.time_budget_s:
            res["variants"][name] = {"skipped": "time budget"}
            continue
        v = VARIANTS[name]
        env = {"UCX_LOG_LEVEL": "info", **v.get("env", {})}
        flags = list(v.get("flags", []))
        specs = engines.pair(
            a.size,
            p_flags=["--no-enable-prefix-caching", *flags],
            d_flags=flags,
            env=env,
            kv_extra=v.get("kv_extra"),
            mem=a.mem,
        )
        devlib.stop_all()  # both sides restart with the variant's settings
        row: dict[str, Any] = {"env": env, "flags": flags, "kv_extra": v.get("kv_extra", {})}
        try:
            row["start_s"] = [devlib.start_engine(s).get("start_s") for s in specs]
        except RuntimeError as exc:
            row["start_error"] = str(exc)[-3000:]
            res["variants"][name] = row
            devlib.write_json(out, res)
            devlib.log(f"{name}: engines did not start")
            continue
        p, d = specs[0].url, specs[1].url
        pairs = devlib.words_for(p, 3000)
        words, allowed = [w for w, _ in pairs], [t for _, t in pairs[:400]]
        row["pulls"] = [measure(p, d, words, allowed, rng, a.tokens) for _ in range(a.pulls)]
        for s in specs:
            lines = [m.group(0) for m in LANE.finditer(devlib.tail(devlib.log_dir() / f"{s.name}.log", 4000))]
            row[f"{s.name}_log"] = lines[:6] + lines[-6:]
        res["variants"][name] = row
        rates = [(x.get(k) or {}).get("gb_per_s") for x in row["pulls"] for k in ("p_to_d", "d_to_p")]
        devlib.log(f"{name}: GB/s {rates}")
        devlib.write_json(out, res)
        if i == len(names) - 1 and a.keep_running:
            break
    if not a.keep_running:
        devlib.stop_all()
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    devlib.write_json(out, res)
    print(
        json.dumps(
            {
                k: [
                    (x.get("p_to_d", {}).get("gb_per_s"), x.get("d_to_p", {}).get("gb_per_s"))
                    for x in v.get("pulls", [])
                ]
                or v.get("skipped")
                or "failed"
                for k, v in res["variants"].items()
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
