"""Run one example against simulated engines and a turnkv gateway, all local, with one command.

    python examples/run.py openai_chat       # or openai_responses, agents_sdk, langgraph, pydantic_ai,
                                             # smolagents, curl; --json for a machine-readable summary

Starts a simulated prefill and decode engine (``turnkv sim``, taking the time their work would take on a
GPU: ``--time-scale 1``), a private redis-server where one is installed, and the gateway (``turnkv serve``)
at its defaults (the ``adaptive`` policy), on free loopback ports; runs the example against the gateway
($TURNKV_URL) with no conversation id anywhere, then prints what turnkv decided for every model call, from
the gateway's turn log. The frameworks come with ``pip install -e '.[examples]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from turnkv import launch
from turnkv.bench.redis_server import RedisNotInstalled, RedisServer

HERE = Path(__file__).resolve().parent
EXAMPLES = {
    "openai_chat": [sys.executable, str(HERE / "openai_chat.py")],
    "openai_responses": [sys.executable, str(HERE / "openai_responses.py")],
    "agents_sdk": [sys.executable, str(HERE / "agents_sdk.py")],
    "langgraph": [sys.executable, str(HERE / "langgraph_agent.py")],
    "pydantic_ai": [sys.executable, str(HERE / "pydantic_ai_agent.py")],
    "smolagents": [sys.executable, str(HERE / "smolagents_agent.py")],
    "curl": ["bash", str(HERE / "curl.sh")],
}
EXAMPLE_TIMEOUT_S = 300.0
LOG_WAIT_S = 10.0
CALLS = "turnkv-example-calls: "


def turn_events(log: Path, count: int) -> list[dict[str, Any]]:
    """The gateway's turn events once it logged ``count`` of them (a streamed turn is logged just after
    its last chunk, so the log can trail the example by a moment); bounded."""
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        lines = log.read_text().split("\n")[:-1]
        found = [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e.get("event") == "turn"]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("example", choices=sorted(EXAMPLES))
    ap.add_argument("--compat", default="0.33", choices=["0.26", "0.33"], help="vLLM wire shape the sims speak")
    ap.add_argument("--template", default="keep", choices=["keep", "strip"],
                    help="keep: the chat template keeps earlier reasoning; strip: drops it, as Qwen3's does")
    ap.add_argument("--policy", default=None, help="the gateway's reuse policy (default: the gateway's, adaptive)")
    ap.add_argument("--time-scale", default="1", help="the sims' simulated durations x this (0: no simulated time)")
    ap.add_argument("--no-redis", action="store_true", help="the gateway's in-process store instead of Redis")
    ap.add_argument("--json", action="store_true", help="end with one JSON line: the calls and turn events")
    args = ap.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="turnkv-example-"))
    sim = ("--time-scale", args.time_scale, "--template", args.template, "--vllm-compat", args.compat)
    procs: list[launch.Running] = []
    redis = None if args.no_redis else _redis()
    gateway_args = [*(["--policy", args.policy] if args.policy else []), *(["--redis-url", redis.url] if redis else [])]
    try:
        procs.append(launch.sim("prefill", "prefill", *sim, log_dir=log_dir))
        procs.append(launch.sim("decode", "decode", *sim, log_dir=log_dir))
        gw = launch.gateway("gateway", [procs[0].url], [procs[1].url], *gateway_args, log_dir=log_dir)
        procs.append(gw)
        store = redis.url if redis else "in-process store"
        print(f"gateway {gw.url} (P {procs[0].url}, D {procs[1].url}, {store}); logs in {log_dir}", flush=True)
        env = {**os.environ, "TURNKV_URL": gw.url, "OPENAI_API_KEY": "turnkv-example",
               "OPENAI_AGENTS_DISABLE_TRACING": "1", "PYTHONUNBUFFERED": "1"}
        run = subprocess.run(EXAMPLES[args.example], env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=EXAMPLE_TIMEOUT_S, check=False)
        print(run.stdout, end="", flush=True)
        calls = next((int(x[len(CALLS):]) for x in run.stdout.splitlines() if x.startswith(CALLS)), 0)
        events = turn_events(log_dir / "gateway.log", calls)
        print("\nturnkv's turn log (one line per model call):")
        print(f"{'#':>3} {'conversation':<17} {'outcome':<12} {'action':<12} {'reason':<20} {'prompt':>6} "
              f"{'matched':>7} {'pulled':>6}")
        for i, e in enumerate(events, 1):
            print(f"{i:>3} {str(e.get('conversation_source')):<17} {e['outcome']:<12} {e['action']:<12} "
                  f"{e['reason']:<20} {e.get('prompt_tokens', 0):>6} {e.get('matched_tokens', 0):>7} "
                  f"{e.get('tokens_planned_pull', 0):>6}")
        if args.json:
            print(json.dumps({"example": args.example, "returncode": run.returncode, "calls": calls,
                              "turns": events}))
        return run.returncode
    finally:
        for p in reversed(procs):
            p.stop()
        if redis is not None:
            redis.close()


def _redis() -> RedisServer | None:
    """A private redis-server for the gateway's store, as a deployment has one; None where none is installed."""
    try:
        return RedisServer().start()
    except RedisNotInstalled:
        print("redis-server is not installed: the gateway keeps conversations in its own process", flush=True)
        return None


if __name__ == "__main__":
    sys.exit(main())
