"""The open-loop load: conversations arrive as a Poisson process and run their turns in order.

At most ``concurrency`` conversations are active; one that arrives while all slots are taken waits
for a slot (its wait is not part of any TTFT). A conversation stops at its last turn, at its first
failed turn (its history would no longer be what the server saw), when the run's request budget
is spent, or at the deadline: no request starts after ``duration_s``, and each one is cut after
``request_timeout_s``, so a run always ends. A caller that must stop sooner cancels the run; the
records it passed in (``records``) keep every request that had finished. Each active conversation
holds a connection (two for pd-direct): the open-file soft limit is raised to fit them, or the run
refuses to start.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable

import aiohttp

from turnkv.bench.client import Target, TurnClient
from turnkv.bench.progress import Progress
from turnkv.bench.records import RequestRecord
from turnkv.bench.workload import Conversation, WorkloadSpec, arrival_offsets

FD_RESERVE = 256  # descriptors besides the load's connections: the event loop, logs, imports


def ensure_fd_room(connections: int) -> int:
    """Raises this process's open-file soft limit, up to the hard limit, so that ``connections`` sockets
    fit next to ``FD_RESERVE``; the soft limit in force. ValueError when the hard limit is too low."""
    need = connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return need if soft == resource.RLIM_INFINITY else soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(
            f"{connections} concurrent connections need {need} open files; the hard limit is {hard} (ulimit -Hn)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


class _Budget:
    def __init__(self, n: int) -> None:
        self.left = n

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


async def run_load(
    spec: WorkloadSpec,
    target: Target,
    *,
    label: str = "bench",
    show_progress: bool = True,
    conversation: Callable[[int, WorkloadSpec], Conversation] = Conversation,
    records: list[RequestRecord] | None = None,
) -> list[RequestRecord]:
    """Runs the workload against ``target`` and returns one record per request sent (appended to
    ``records`` as each finishes, where given). ``conversation`` makes each conversation."""
    records = [] if records is None else records
    # at most as many conversations run at once as there are (an open-loop sweep sets no real cap)
    ensure_fd_room(min(spec.concurrency, spec.conversations) * (2 if target.kind == "pd-direct" else 1))
    total = min(spec.conversations * spec.turns, spec.max_requests)
    progress = Progress(label, total)
    budget = _Budget(spec.max_requests)
    slots = asyncio.Semaphore(spec.concurrency)
    start = time.perf_counter()
    deadline = start + spec.duration_s
    # idle connections reused within 4 s only: below vLLM's (and the simulator's) 5 s keep-alive, so a
    # run straight against an engine never sends on a connection the engine is closing
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        client = TurnClient(session, target, spec.request_timeout_s)

        async def one(index: int, arrives: float) -> None:
            await asyncio.sleep(max(0.0, min(start + arrives, deadline) - time.perf_counter()))
            async with slots:
                conv = conversation(index, spec)  # made once it runs: a long queue holds no texts
                progress.active += 1
                try:
                    await _turns(conv, client, spec, start, deadline, budget, records, progress)
                finally:
                    progress.active -= 1

        bar = asyncio.create_task(progress.run(show_progress))
        try:
            async with asyncio.TaskGroup() as tg:
                for i, t in enumerate(arrival_offsets(spec)):
                    tg.create_task(one(i, t))
        finally:
            bar.cancel()
            await asyncio.gather(bar, return_exceptions=True)
    records.sort(key=lambda r: (r.start_s, r.conversation))
    return records


async def _turns(
    conv: Conversation,
    client: TurnClient,
    spec: WorkloadSpec,
    start: float,
    deadline: float,
    budget: _Budget,
    records: list[RequestRecord],
    progress: Progress,
) -> None:
    headers = {"x-session-id": conv.session_id} if spec.session_header else {}
    for t in range(spec.turns):
        if time.perf_counter() >= deadline or not budget.take():
            return
        body = conv.next_request()
        sent = time.perf_counter()
        out = await client.send(body, headers, conv.index)
        rec = RequestRecord(
            conversation=conv.index,
            turn=conv.turn,
            start_s=sent - start,
            ttft_ms=None if out.ttft_s is None else out.ttft_s * 1e3,
            latency_ms=None if out.latency_s is None else out.latency_s * 1e3,
            itl_ms=out.itl_ms,
            chunks=out.chunks,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            status=out.status,
            error=out.error,
            decision=out.decision,
        )
        records.append(rec)
        progress.done += 1
        if out.error is not None:
            progress.errors += 1
            return
        conv.answered(out.content, out.reasoning)
        if t + 1 < spec.turns:
            await asyncio.sleep(min(conv.think_time(), max(0.0, deadline - time.perf_counter())))
