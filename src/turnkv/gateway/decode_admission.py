"""Decode admission: a turn goes to a decode engine only when that engine's KV can hold it.

vLLM's decode engine reserves blocks for a P -> D turn as soon as it schedules the pull of P's KV,
and pins a finished turn's blocks for the next one. Sent more than it can hold, it fills up with
reservations for pulls and with pins while nothing runs; P keeps its own blocks leased for pulls
that do not come, and the releases turnkv sends through P queue behind prefills P cannot schedule:
on the H200 at 64 conversations of 8k tokens (twice what D holds) D sat at 98% KV with 0 running for
minutes. So the gateway holds turns back itself, at the moment they would reach D (after P's prefill,
not before it: a turn queued at P holds nothing on D): each reserves its context (prompt and answer
tokens) against ``admit_share`` of the engine's capacity, less what stored handles pin there; a turn
that does not fit waits, first come first served. A decode-local turn waits at most ``wait_s``, then
gets a 503 with ``Retry-After``. A turn whose KV P holds for D waits at most ``overflow_s``, below P's
lease (``kv_lease_duration``, 30 s by default: past it P frees what D was to pull), then goes to D all
the same, whose own queue keeps P's lease alive: a bounded wait that never wastes P's work.
An engine whose capacity is not known admits everything. A turn larger than the whole share is
admitted alone, when nothing else is in flight there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from turnkv.errors import Overloaded


@dataclass
class _Engine:
    reserved: int = 0
    in_flight: int = 0
    queue: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)


class Ticket:
    """A reservation; ``release`` gives it back (once, whatever calls it more)."""

    def __init__(self, admission: DecodeAdmission, url: str, tokens: int, *, overflowed: bool = False) -> None:
        self._admission, self.url, self.tokens = admission, url, tokens
        self.overflowed = overflowed  # admitted past its wait, without room
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._give_back(self.url, self.tokens)


class DecodeAdmission:
    def __init__(
        self,
        *,
        capacity: Callable[[str], int | None],
        pinned: Callable[[str], int],
        admit_share: float,
        wait_s: float,
        on_wait: Callable[[str], None] = lambda url: None,
    ) -> None:
        self._capacity = capacity  # the engine's KV tokens, when known
        self._pinned = pinned  # what stored handles pin there (gateway.pins' estimate)
        self._share = admit_share
        self._wait_s = wait_s
        self._on_wait = on_wait
        self._engines: dict[str, _Engine] = {}

    def room(self, url: str) -> int | None:
        """Tokens a new turn may still reserve on ``url`` now (None: no limit known)."""
        cap = self._capacity(url)
        if cap is None:
            return None
        e = self._engines.get(url) or _Engine()
        return int(cap * self._share) - self._pinned(url) - e.reserved

    def _fits(self, url: str, tokens: int) -> bool:
        room = self.room(url)
        e = self._engines.setdefault(url, _Engine())
        return room is None or tokens <= room or e.in_flight == 0

    def queued(self, url: str) -> int:
        """Turns waiting in the gateway for room on ``url`` now."""
        e = self._engines.get(url)
        return sum(1 for _, fut in e.queue if not fut.done()) if e else 0

    def reserved(self, url: str) -> int:
        e = self._engines.get(url)
        return e.reserved if e else 0

    async def acquire(self, url: str, tokens: int, *, overflow_after_s: float | None = None) -> Ticket:
        """Reserve ``tokens`` on ``url``, waiting (bounded, first come first served) for room; the ticket
        gives it back. Past the wait: ``Overloaded``, or with ``overflow_after_s`` (that long instead of
        ``wait_s``) the room is taken all the same (``Ticket.overflowed``)."""
        e = self._engines.setdefault(url, _Engine())
        if not e.queue and self._fits(url, tokens):
            self._take(url, tokens)
            return Ticket(self, url, tokens)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        e.queue.append((tokens, fut))
        self._on_wait(url)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self._wait_s if overflow_after_s is None else overflow_after_s)
        except TimeoutError:
            if not fut.done():
                e.queue.remove((tokens, fut))
                self._wake(url)
                if overflow_after_s is not None:
                    self._take(url, tokens)
                    return Ticket(self, url, tokens, overflowed=True)
                raise Overloaded(
                    "the decode engines are full; send the turn again", retry_after_s=max(1, round(self._wait_s / 4))
                ) from None
        except BaseException:
            if (tokens, fut) in e.queue:
                e.queue.remove((tokens, fut))
                self._wake(url)
            elif fut.done():  # admitted as it was cancelled: give the room back
                self._give_back(url, tokens)
            raise
        return Ticket(self, url, tokens)

    @contextlib.asynccontextmanager
    async def hold(self, url: str, tokens: int) -> AsyncIterator[None]:
        """``acquire`` for as long as the block runs."""
        ticket = await self.acquire(url, tokens)
        try:
            yield
        finally:
            ticket.release()

    def _take(self, url: str, tokens: int) -> None:
        e = self._engines[url]
        e.reserved += tokens
        e.in_flight += 1

    def _give_back(self, url: str, tokens: int) -> None:
        e = self._engines[url]
        e.reserved -= tokens
        e.in_flight -= 1
        self._wake(url)

    def _wake(self, url: str) -> None:
        """Admit waiting turns in order while they fit (and pins released meanwhile count)."""
        e = self._engines[url]
        while e.queue:
            tokens, fut = e.queue[0]
            if fut.done():
                e.queue.popleft()
                continue
            if not self._fits(url, tokens):
                return
            e.queue.popleft()
            self._take(url, tokens)
            fut.set_result(None)

    def wake(self, url: str) -> None:
        """Pins were released on ``url``: room may have appeared there."""
        if url in self._engines:
            self._wake(url)
