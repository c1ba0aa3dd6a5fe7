"""Load on the conversation store alone: N conversations, each running turns back to back (claim,
the turn's work on the event loop, put), through the store guard, against a redis-server of its own.

Compares the store before this change (its RedisStore from git: a 64-connection blocking pool
that waits at most the command timeout, a ``retry=`` that redis-py ignores) with the current one,
both behind the current guard (which opens for ``store_retry_s`` on any error that is not
``StoreBusy``; the old store never raised that). Optionally Redis is stopped for a second mid-run.

    .venv/bin/python scripts/store_load.py --streams 1000 --turns 6
    .venv/bin/python scripts/store_load.py --streams 1000 --turns 12 --outage-at 3 --settle-s 2.5
    .venv/bin/python scripts/store_load.py --restart-probe 32

Reports per store: turns, turns that ran stateless (claim or put failed or skipped while the guard
was open), claims that met an in-flight marker (left behind by a put that failed: every
conversation here is sequential), StoreBusy and other errors, times the guard opened, round trips
per turn (counted at a relay) and Redis CPU. Not a test: timings vary with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from turnkv.bench.procs import RoundTripRelay
from turnkv.bench.redis_server import RedisServer
from turnkv.errors import StoreBusy, StoreError
from turnkv.reuse.chain import chain_of
from turnkv.state.base import ClaimStatus
from turnkv.state.guard import StoreGuard
from turnkv.state.record import ConversationRecord
from turnkv.state.redis import RedisStore

OLD_COMMIT = "394d23c"  # the contract change; redis.py there is still the old store
ROOT = Path(__file__).resolve().parent.parent


def record(key: str, turn: int) -> ConversationRecord:
    now = time.time()
    return ConversationRecord(
        tenant="t",
        decode_url=f"http://d{hash(key) % 4}:8200",
        prefill_url=None,
        handle={
            "remote_request_id": f"{key}-{turn}",
            "remote_engine_id": "e",
            "remote_block_ids": list(range(64)),
            "remote_num_tokens": 1024,
            "do_remote_prefill": True,
        },
        engine_id="e",
        engine_epoch=None,
        num_tokens=1024,
        chain=chain_of(list(range(1024)), 16),
        block_size=16,
        prompt_tokens=900,
        answer_digest="a",
        reasoning_digest=None,
        turn=turn,
        created_at=now,
        expires_at=now + 460.0,
    )


class OldStore:
    """The store before this change, on the old contract (claim(key), release(key)), from git."""

    def __init__(self, url: str, timeout_s: float) -> None:
        src = subprocess.run(
            ["git", "show", f"{OLD_COMMIT}:src/turnkv/state/redis.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        path = Path(tempfile.mkdtemp()) / "old_redis_store.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("old_redis_store", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.inner: Any = module.RedisStore.from_url(url, timeout_s=timeout_s)

    async def claim(self, key: str, *, owner: str) -> Any:
        return await self.inner.claim(key)

    async def put(self, key: str, rec: ConversationRecord, ttl_s: float) -> None:
        await self.inner.put(key, rec, ttl_s)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Tally:
    turns: int = 0
    stateless: int = 0
    found: int = 0
    in_flight: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    why: Counter[str] = field(default_factory=Counter)  # the errors' messages, without their variable parts
    guard_opened: int = 0
    after_outage: int = 0
    after_outage_stateless: int = 0

    def count(self, exc: StoreError) -> None:
        self.errors["busy" if isinstance(exc, StoreBusy) else "error"] += 1
        self.why[str(exc).split(":")[-1].strip()[:60]] += 1


def busy_work(ms: float) -> None:
    """The turn's share of the gateway's event loop (parsing, SSE, JSON): it delays everything else."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


async def conversation(i: int, guard: StoreGuard, args: argparse.Namespace, tally: Tally, back_at: list[float]) -> None:
    key = f"conv-{i}"
    rng = random.Random(i)
    for turn in range(args.turns):
        started = time.monotonic()
        after = bool(back_at) and started > back_at[0] + args.settle_s
        stateless = False
        try:
            c = await guard.claim(key, owner=f"{key}-{turn}")
            if c.status is ClaimStatus.FOUND:
                tally.found += 1
            elif c.status is ClaimStatus.IN_FLIGHT:
                tally.in_flight += 1
        except StoreError as exc:
            tally.count(exc)
            stateless = True
        # the turn: a few chunks, each some CPU on the loop, then a wait on the engine
        chunks = 8
        for _ in range(chunks):
            busy_work(args.cpu_ms / chunks)
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.turn_s / chunks)
        try:
            await guard.put(key, record(key, turn), 600.0)
        except StoreError as exc:
            tally.count(exc)
            stateless = True
        tally.turns += 1
        tally.stateless += stateless
        if after:
            tally.after_outage += 1
            tally.after_outage_stateless += stateless


async def run(kind: str, server: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    redis.Redis(port=server.port).flushall()
    relay = RoundTripRelay(server.port)
    if args.count_round_trips:  # a relay thread in this process: it slows the client, so only on request
        relay.start()
    url = relay.url if args.count_round_trips else f"redis://127.0.0.1:{server.port}/0"
    store: Any = (
        OldStore(url, args.redis_timeout_s)
        if kind == "old"
        else RedisStore.from_url(
            url,
            command_timeout_s=args.redis_timeout_s,
            max_connections=args.max_connections,
            pool_timeout_s=args.pool_timeout_s,
        )
    )
    tally = Tally()
    guard = StoreGuard(
        store,
        retry_s=args.store_retry_s,
        on_state=lambda up: setattr(tally, "guard_opened", tally.guard_opened + (not up)),
    )
    back_at: list[float] = []

    async def outage() -> None:
        await asyncio.sleep(args.outage_at)
        server.stop()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(server.start)
        back_at.append(time.monotonic())

    cpu0 = server.cpu_s()
    t0 = time.monotonic()
    tasks = [asyncio.create_task(conversation(i, guard, args, tally, back_at)) for i in range(args.streams)]
    if args.outage_at:
        tasks.append(asyncio.create_task(outage()))
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    cpu = server.cpu_s() - (0.0 if args.outage_at else cpu0)
    await store.close()
    if args.count_round_trips:
        relay.stop()
    name = "old" if kind == "old" else f"new pool={args.max_connections} wait={args.pool_timeout_s}s"
    out: dict[str, Any] = {
        "store": name,
        "turns": tally.turns,
        "stateless": tally.stateless,
        "stateless_pct": round(100 * tally.stateless / max(1, tally.turns), 1),
        "claims_found": tally.found,
        "claims_in_flight": tally.in_flight,
        "store_busy": tally.errors["busy"],
        "store_errors": tally.errors["error"],
        "guard_opened": tally.guard_opened,
        "wall_s": round(wall, 1),
        "redis_cpu_pct": round(100 * cpu / wall, 1),
        "why": dict(tally.why.most_common(4)),
    }
    if args.count_round_trips:
        out.update(
            round_trips_per_turn=round(relay.round_trips / max(1, tally.turns), 2),
            round_trips_by_command=dict(relay.by_command),
        )
    if args.outage_at:
        out.update(turns_after_back=tally.after_outage, stateless_after_back=tally.after_outage_stateless)
    return out


async def restart_probe(kind: str, server: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    """``n`` pooled connections, Redis restarted, then ``n`` calls at once: how many fail."""
    n = args.restart_probe
    url = f"redis://127.0.0.1:{server.port}/0"
    store: Any = (
        OldStore(url, args.redis_timeout_s)
        if kind == "old"
        else RedisStore.from_url(url, command_timeout_s=args.redis_timeout_s)
    )
    await asyncio.gather(*(store.put(f"k{i}", record(f"k{i}", 0), 600.0) for i in range(n)))
    server.stop()
    await asyncio.to_thread(server.start)
    got = await asyncio.gather(*(store.claim(f"k{i}", owner="o") for i in range(n)), return_exceptions=True)
    await store.close()
    return {"store": kind, "calls_after_restart": n, "failed": sum(isinstance(g, Exception) for g in got)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-s", type=float, default=1.0, help="mean time a turn waits on engines")
    p.add_argument("--cpu-ms", type=float, default=0.5, help="event-loop CPU per turn (the gateway's own work)")
    p.add_argument("--redis-timeout-s", type=float, default=0.25, help="timeouts.redis_s")
    p.add_argument("--store-retry-s", type=float, default=2.0)
    p.add_argument("--outage-at", type=float, default=0.0, help="stop Redis for 1 s this long into the run")
    p.add_argument("--settle-s", type=float, default=0.0, help="count turns starting this long after Redis is back")
    p.add_argument("--stores", default="old,new")
    p.add_argument("--count-round-trips", action="store_true")
    p.add_argument("--restart-probe", type=int, default=0, help="instead: N pooled connections, restart, N calls")
    p.add_argument("--max-connections", type=int, default=256, help="the new store's redis_max_connections")
    p.add_argument("--pool-timeout-s", type=float, default=0.5, help="the new store's redis_pool_timeout_s")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(Path(d)).start()
        try:
            for kind in args.stores.split(","):
                probe = restart_probe if args.restart_probe else run
                print(json.dumps(asyncio.run(probe(kind, server, args))), flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
