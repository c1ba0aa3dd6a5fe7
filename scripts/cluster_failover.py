"""One Redis Cluster master killed under conversations' load: what it costs the conversations on the
masters that stayed up, and how long the failed master's take to get their store back.

A real Cluster on loopback (3 masters, a replica each, ``cluster-require-full-coverage no``), a real
gateway on simulated engines, conversations driven with the openai SDK, back to back
(tests/integration/failover_load.py). ``--gateway-src`` runs the gateway from another copy of
``src/`` (the store before a change, e.g. ``git archive <commit> src | tar -x -C /tmp/before``) while
everything else stays as it is, so two stores meet the same scenario side by side.

    .venv/bin/python scripts/cluster_failover.py --kill index --kill most
    .venv/bin/python scripts/cluster_failover.py --gateway-src /tmp/before/src --kill index --kill most

``--kill index``: the master that holds the decode engine's pin index (every conversation's pin entries
are on it); ``--kill most``: the master serving the most conversations; ``--kill sentinel``: the master of
a Sentinel set-up (master, replica, one Sentinel counting it down after ``--node-timeout-ms``). Reports
per run: the failover (kill -> a replica serves the slots), the other masters' turns after the kill
(reused / all, and those in the failover window), the failed master's conversations (store back, reuse
back), turns not answered.
Not a test: timings vary with the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration import failover_load
from tests.integration.cluster import start_cluster
from tests.integration.redis_topologies import redis_cluster_setup, redis_sentinel

from turnkv import launch


def one_run(kill: str, conversations: int, node_timeout_ms: int, gateway_src: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="turnkv-failover-") as tmp:
        work = Path(tmp)
        return _in(work, kill, conversations, node_timeout_ms, gateway_src)


def _in(work: Path, kill: str, conversations: int, node_timeout_ms: int, gateway_src: str | None) -> dict[str, Any]:
    (work / "redis").mkdir()
    procs: list[launch.Running] = []
    env = {"PYTHONPATH": gateway_src} if gateway_src else None
    try:
        if kill == "sentinel":  # Sentinel counts the master down after the same time
            with redis_sentinel(work / "redis", down_after_ms=node_timeout_ms) as sentinel:
                gw = start_cluster(procs, work, redis_url=sentinel.url, gateway_env=env)
                run = failover_load.run_sentinel(gw, sentinel, conversations=conversations)
                procs = _stopped(procs)
        else:
            with redis_cluster_setup(
                work / "redis", replicas=1, node_timeout_ms=node_timeout_ms, full_coverage=False
            ) as rc:
                gw = start_cluster(procs, work, redis_url=rc.url, gateway_env=env)
                run = failover_load.run(gw, rc, conversations=conversations, kill=kill)
                procs = _stopped(procs)
    finally:
        _stopped(procs)
    return summary(run)


def _stopped(procs: list[launch.Running]) -> list[launch.Running]:
    """Stop the gateway and engines (before their Redis goes); nothing is left to stop."""
    for p in reversed(procs):
        p.stop()
    return []


def summary(run: failover_load.Failover) -> dict[str, Any]:
    reused, turns = run.others_reuse()
    window = [s for s in run.after_kill(on_victim=False) if run.at(s) <= run.failed_over_s]
    victims = {str(c): [None if x is None else round(x, 2) for x in run.recovery(c)] for c in run.victims()}
    return {
        "victim": run.victim,
        "conversations_on_victim": len(run.victims()),
        "failover_s": round(run.failed_over_s, 2),
        "others_after_kill": {"reused": reused, "turns": turns, "share": round(reused / turns, 3) if turns else None},
        "others_in_failover_window": {"reused": sum(s.reused for s in window), "turns": len(window)},
        "others_store_unavailable": sum(s.reason == failover_load.STORE_DOWN for s in run.after_kill(on_victim=False)),
        "victims_store_back_s_reuse_back_s": victims,
        "others_not_reused": dict(
            Counter(f"{s.outcome}/{s.reason}" for s in run.after_kill(on_victim=False) if not s.reused)
        ),
        "turns_not_answered": len(run.errors()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--kill", action="append", choices=["index", "most", "sentinel"], help="one run each (default: index)"
    )
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--node-timeout-ms", type=int, default=2000, help="cluster-node-timeout (Redis's default 15000)")
    ap.add_argument("--gateway-src", help="PYTHONPATH for the gateway: another copy of src/")
    ap.add_argument("--keep", type=Path, help="run in this directory and keep its logs (one run per --kill)")
    args = ap.parse_args()
    for kill in args.kill or ["index"]:
        if args.keep:
            (args.keep / kill).mkdir(parents=True)
            out = _in(args.keep / kill, kill, args.conversations, args.node_timeout_ms, args.gateway_src)
        else:
            out = one_run(kill, args.conversations, args.node_timeout_ms, args.gateway_src)
        print(json.dumps({"kill": kill, "gateway_src": args.gateway_src or "this tree", **out}), flush=True)


if __name__ == "__main__":
    main()
