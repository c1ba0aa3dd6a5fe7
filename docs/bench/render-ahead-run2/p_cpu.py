"""P's own CPU per call on the simulator (render-ahead run 2): the render call, and a 1-token chat prefill with and
without ``return_token_ids``, at 16k and 32k tokens. Run from the repository root: ``python docs/bench/...``.
CPU from /proc/<pid>/stat (10 ms ticks; 60 calls each)."""

import json
import os
import random
import urllib.request
from pathlib import Path

from turnkv import launch
from turnkv.bench.workload import words

REPS = 60


def cpu(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


logs = Path("/tmp/p-cpu-logs")
logs.mkdir(exist_ok=True)
p = launch.sim("p", "prefill", "--time-scale", "0", "--vllm-compat", "0.33", "--no-prefix-caching", log_dir=logs)
try:
    rng = random.Random(0)
    for n in (16000, 32000):
        msgs = [{"role": "system", "content": words(rng, n)}, {"role": "user", "content": "hello there"}]
        base = {"model": "sim-model", "messages": msgs}
        kinds = {
            "render": ("/v1/chat/completions/render", base),
            "prefill": ("/v1/chat/completions", {**base, "max_tokens": 1, "stream": False}),
            "prefill+ids": ("/v1/chat/completions", {**base, "max_tokens": 1, "stream": False, "return_token_ids": True}),
        }
        for k, (path, body) in kinds.items():
            post(p.url + path, body)
            c0 = cpu(p.proc.pid)
            size = 0
            for _ in range(REPS):
                size = len(post(p.url + path, body))
            print(f"{n} {k:12s} P CPU {(cpu(p.proc.pid) - c0) / REPS * 1e3:6.1f} ms/call, answer {size} bytes", flush=True)
finally:
    p.stop()
