"""A Redis Cluster master killed under conversations' load, through a real gateway on simulated engines:
which conversations kept their reuse, and how long the failed master's took to get it back.

Each conversation is an agent-style dialogue (the openai SDK, turns back to back, one thread each). Its
first turn runs alone, so the test sees which master its record went to. Then all run at once, a master
is SIGKILLed mid-load, and the load goes on until its replica serves the slots and each of the failed
master's conversations has reused again. On Sentinel (``run_sentinel``) the one master is killed: every
conversation is the failed master's, until Sentinel promotes the replica. Used by
tests/integration/test_cluster_failover.py (one run: the criterion) and scripts/cluster_failover.py (runs
for BENCHMARKS.md). Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import openai

from tests.integration.cluster import Cluster, Dialogue
from tests.integration.redis_topologies import ClusterSetup, SentinelSetup
from turnkv.bench.redis_server import RedisServer

REUSED = frozenset({"full", "partial", "decode_local"})  # outcomes that used the record's KV
STORE_DOWN = "store_unavailable"
POLL_S = 0.05
JOIN_S = 90.0  # a turn's own deadline (the SDK's 60 s) and some


@dataclass(frozen=True)
class Sample:
    """One turn: its conversation, when it started (``time.monotonic``), its length, and what the
    gateway said (``error``: the client's exception, if any)."""

    conversation: int
    started: float
    seconds: float
    outcome: str
    reason: str
    error: str = ""

    @property
    def reused(self) -> bool:
        return self.outcome in REUSED


@dataclass
class Failover:
    victim: int  # the killed master's port
    master_of: dict[int, int]  # conversation -> its master's port when the victim was killed
    killed_at: float  # time.monotonic
    failed_over_s: float  # kill -> a replica serves the victim's slots and every node says ok
    samples: list[Sample] = field(default_factory=list)

    def at(self, s: Sample) -> float:
        """When ``s`` started, in seconds from the kill (negative before)."""
        return s.started - self.killed_at

    def victims(self) -> list[int]:
        return sorted(c for c, port in self.master_of.items() if port == self.victim)

    def after_kill(self, *, on_victim: bool) -> list[Sample]:
        return [
            s for s in self.samples if self.at(s) >= 0 and (self.master_of[s.conversation] == self.victim) == on_victim
        ]

    def others_reuse(self) -> tuple[int, int]:
        """Turns of the other masters' conversations that started after the kill: reused, all."""
        turns = self.after_kill(on_victim=False)
        return sum(s.reused for s in turns), len(turns)

    def recovery(self, conversation: int) -> tuple[float | None, float | None]:
        """Seconds from the kill to the start of the conversation's first turn the store answered again
        (its reason is not ``store_unavailable``), and of its first turn that reused."""
        turns = sorted(
            (s for s in self.samples if s.conversation == conversation and self.at(s) >= 0), key=lambda s: s.started
        )
        down = [i for i, s in enumerate(turns) if s.reason == STORE_DOWN]
        later = turns[down[-1] + 1 :] if down else turns
        answered = next((self.at(s) for s in later), None)
        reused = next((self.at(s) for s in later if s.reused), None)
        return answered, reused

    def errors(self) -> list[Sample]:
        return [s for s in self.samples if s.error]


def keys_on(server: RedisServer, pattern: str) -> set[str]:
    c = server.client(decode_responses=True)
    try:
        return {str(k) for k in c.scan_iter(match=pattern, count=1000)}
    finally:
        c.close()


def wait_until(check: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(POLL_S)


@contextlib.contextmanager
def _driven(dialogues: Sequence[Dialogue], out: list[Sample]) -> Iterator[None]:
    """Every dialogue's turns back to back in a thread of its own until the block ends."""
    stop = threading.Event()

    def drive(i: int, d: Dialogue) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                turn = d.step(truth=False)
            except (openai.APIError, OSError) as exc:
                out.append(Sample(i, t0, time.monotonic() - t0, "", "", repr(exc)))
                stop.wait(0.1)  # a gateway that refuses at once is not asked in a tight loop
                continue
            out.append(Sample(i, t0, time.monotonic() - t0, turn.outcome, turn.reason))

    threads = [threading.Thread(target=drive, args=(i, d), daemon=True) for i, d in enumerate(dialogues)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(JOIN_S)


def _count(samples: list[Sample], conversations: int, pred: Callable[[Sample], bool]) -> dict[int, int]:
    """Per conversation, the samples so far (the driving threads append to the list) that ``pred`` holds for."""
    out = dict.fromkeys(range(conversations), 0)
    for s in list(samples):
        out[s.conversation] += pred(s)
    return out


def run(
    gw: Cluster,
    cluster: ClusterSetup,
    *,
    conversations: int = 12,
    kill: str = "index",
    turns_before: int = 3,
    turns_after: int = 6,
    max_tokens: int = 16,
    timeout_s: float = 60.0,
) -> Failover:
    """The scenario. ``kill``: ``index`` (the master that holds the decode engine's pin index, so that
    every conversation's pins are indexed on the failed master) or ``most`` (the one serving the most
    conversations). ``turns_before``: turns of every conversation before the kill; ``turns_after``:
    turns each other master's conversation takes after the kill (at least), while each of the victim's
    reuses again after the failover."""
    dialogues = [Dialogue(gw, session=f"failover-{i}", max_tokens=max_tokens) for i in range(conversations)]
    try:
        master_of = _first_turns(dialogues, cluster)
        victim = _victim(cluster, master_of, kill)
        samples: list[Sample] = []

        def count(pred: Callable[[Sample], bool]) -> dict[int, int]:
            return _count(samples, conversations, pred)

        with _driven(dialogues, samples):
            wait_until(lambda: min(count(lambda s: True).values()) >= turns_before, "turns before the kill", timeout_s)
            killed_at = time.monotonic()
            cluster.kill(next(s for s in cluster.servers if s.port == victim))
            cluster.wait_failed_over(victim, timeout_s)
            failed_at = time.monotonic()
            victims = [c for c, p in master_of.items() if p == victim]

            def done() -> bool:
                after = count(lambda s: s.started >= failed_at)
                reused = count(lambda s: s.started >= failed_at and s.reused)
                others = [c for c in master_of if c not in victims]
                return all(reused[c] >= 1 for c in victims) and all(after[c] >= turns_after for c in others)

            wait_until(done, "the failed master's conversations reusing again", timeout_s)
        return Failover(victim, master_of, killed_at, failed_at - killed_at, samples)
    finally:
        for d in dialogues:
            d.__exit__()


def run_sentinel(
    gw: Cluster,
    sentinel: SentinelSetup,
    *,
    conversations: int = 8,
    turns_before: int = 3,
    max_tokens: int = 16,
    timeout_s: float = 60.0,
) -> Failover:
    """The scenario on Sentinel: one master serves every conversation, so its crash costs them all until
    Sentinel promotes the replica; then each reuses again (the records the replica had)."""
    dialogues = [Dialogue(gw, session=f"failover-{i}", max_tokens=max_tokens) for i in range(conversations)]
    try:
        victim = sentinel.master.port
        samples: list[Sample] = []

        def count(pred: Callable[[Sample], bool]) -> dict[int, int]:
            return _count(samples, conversations, pred)

        with _driven(dialogues, samples):
            wait_until(lambda: min(count(lambda s: True).values()) >= turns_before, "turns before the kill", timeout_s)
            killed_at = time.monotonic()
            sentinel.kill_master(timeout_s)
            failed_at = time.monotonic()
            wait_until(
                lambda: min(count(lambda s: s.started >= failed_at and s.reused).values()) >= 1,
                "every conversation reusing again",
                timeout_s,
            )
        return Failover(victim, dict.fromkeys(range(conversations), victim), killed_at, failed_at - killed_at, samples)
    finally:
        for d in dialogues:
            d.__exit__()


def _first_turns(dialogues: Sequence[Dialogue], cluster: ClusterSetup) -> dict[int, int]:
    """Each conversation's first turn, alone: its record is the one new conversation key on a master."""
    masters = cluster.masters()
    seen: dict[str, int] = {}
    master_of: dict[int, int] = {}
    for i, d in enumerate(dialogues):
        d.step(truth=False)
        now = {k: m.port for m in masters for k in keys_on(m, "turnkv:c:*")}
        new = set(now) - set(seen)
        assert len(new) == 1, f"conversation {i}: {len(new)} new records"
        master_of[i] = now[new.pop()]
        seen = now
    return master_of


def _victim(cluster: ClusterSetup, master_of: dict[int, int], kill: str) -> int:
    if kill == "most":
        ports = list(master_of.values())
        return max(set(ports), key=ports.count)
    holders = [m.port for m in cluster.masters() if keys_on(m, "turnkv:pins:*")]
    assert len(holders) == 1, f"one decode engine's pin index on one master, found on {holders}"
    return holders[0]
