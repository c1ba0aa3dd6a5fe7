"""The transfer probe: a few turns through one P and one D, each measured by the engines' own transfer
counters, kept small and bounded so it can run against engines that serve traffic.

Per size (smallest first), with prompts of token ids under a cache salt of the probe's own, so neither
engine's prefix cache has them and no client's cache entry is touched:

1. a plain P/D turn: P prefills the prompt cold (its call timed: P's compute), D reads P's KV (P -> D,
   from D's counters) and answers one token; with bidirectional transfer D returns its own handle;
2. a pull: the same prompt under another salt, with D's handle trimmed to the whole blocks before the
   last token, so P reads D's KV (D -> P, from P's counters) and computes only the rest;
3. the pull's turn is finished on D (D already holds those tokens, so it reads at most a block), and
   the handle D returns is given back at once (a release through P): the probe leaves nothing pinned.

A P without bidirectional transfer accepts D's handle and waits for a read it never starts (vLLM
0.26-0.33): the pull has a deadline (ten times what P -> D took, or the last pull predicts, at least ten
seconds), past which it is given up (closing the request makes the engine abort it) and reported. The
smallest size runs once first, uncounted (connections, first use). A size longer than the engines take
(max_model_len) or than a quarter of either engine's KV is cut to fit; one whose turn the time budget
cannot fit (judged from the size before it) is skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from turnkv.doctor.facts import Load, PullOutcome, Sample, SizeRun, TransferFacts
from turnkv.engine.base import CallMeta, DecodeCall, Engine, Handle, HandleFacts, HandleUse, PrefillCall
from turnkv.engine.diagnostics import EngineDiagnostics, TransferTotals
from turnkv.errors import UpstreamError, UpstreamStatus, UpstreamTimeout

SETTLE_S = 3.0  # how long an engine's counters may lag the answer that made a transfer
SETTLE_TICK_S = 0.05
KV_SHARE = 0.25  # the most of an engine's KV one probe prompt may take
PULL_DEADLINE_MIN_S = 10.0
PULL_DEADLINE_FACTOR = 10.0  # times what P -> D took for the same prompt
GROWTH = 1.3  # a size's turn predicted from the last one's, scaled by the ratio of sizes to this power
FILLER = (
    "The doctor measures how fast the engines move KV between them, before anything else is benchmarked. "
    "Every later turn depends on it: a slow link makes a pull cost more than recomputing the history. "
)


@dataclass(frozen=True)
class Plan:
    prefill: str
    decode: str
    model: str | None
    block_size: int
    sizes: tuple[int, ...]
    budget_s: float  # the whole probe
    call_timeout_s: float  # a prefill or decode call other than the pull
    max_tokens: int | None  # the longest prompt both engines take (max_model_len), when known
    capacity: int | None  # the smaller KV capacity of the two, in tokens, when known
    run_id: str
    tokenizers: tuple[str, ...]  # engines to make the prompt's ids on, in order


@dataclass
class _State:
    runs: list[SizeRun] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    p_hands_off: bool | None = None
    d_handle: bool | None = None
    pull: PullOutcome = PullOutcome.NOT_TRIED
    pull_detail: str = ""
    push_failed: str | None = None
    p_endpoint: str | None = None
    d_endpoint: str | None = None
    load: Load = field(default_factory=Load)
    stop: bool = False


class Probe:
    def __init__(
        self, engine: Engine, probes: EngineDiagnostics, plan: Plan, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engine = engine
        self.probes = probes
        self.plan = plan
        self.clock = clock
        self.s = _State()
        self.turns = 0
        self.last_pull: tuple[int, float] | None = None  # tokens and seconds of the last pull measured

    async def run(self) -> TransferFacts:
        started = self.clock()
        base = await self._ids()
        if base is None:
            self.s.skipped.append("no engine would make token ids for the probe's prompts")
        else:
            last: tuple[int, float] | None = None
            sizes = self._sizes()
            if sizes:
                await self._warm_up(base, sizes[0])
            for n in sizes:
                if self.s.stop:
                    break
                why = self._unfit(n, last, self.clock() - started)
                if why is not None:
                    self.s.skipped.append(f"the probe of {n} tokens skipped: {why}")
                    continue
                t0 = self.clock()
                await self._size(n, (base * (n // len(base) + 1))[:n])
                last = (n, self.clock() - t0)
        s = self.s
        return TransferFacts(
            prefill=self.plan.prefill,
            decode=self.plan.decode,
            block_size=self.plan.block_size,
            runs=tuple(s.runs),
            p_hands_off=s.p_hands_off,
            d_handle=s.d_handle,
            pull=s.pull,
            pull_detail=s.pull_detail,
            push_failed=s.push_failed,
            p_endpoint=s.p_endpoint,
            d_endpoint=s.d_endpoint,
            skipped=tuple(s.skipped),
            load=replace(s.load, seconds=round(self.clock() - started, 3)),
        )

    async def _ids(self) -> list[int] | None:
        for url in self.plan.tokenizers:
            try:
                ids = await self.probes.tokenize(url, FILLER * 4, self.plan.model)
            except UpstreamError:
                continue
            if ids:
                return ids
        return None

    def _sizes(self) -> list[int]:
        """The sizes asked for, each cut to what the engines take: a prompt and its one answer token within
        max_model_len, and at most ``KV_SHARE`` of either engine's KV (whole blocks)."""
        p = self.plan
        limits = [(p.max_tokens - 1, f"max_model_len {p.max_tokens}")] if p.max_tokens is not None else []
        if p.capacity is not None:
            limits.append((int(KV_SHARE * p.capacity), f"{KV_SHARE:.0%} of an engine's KV"))
        out: set[int] = set()
        for n in sorted(set(p.sizes)):
            for limit, why in limits:
                cut = limit // p.block_size * p.block_size
                if n > cut:
                    self.s.skipped.append(f"the probe of {n} tokens cut to {cut}: more than {why} allows")
                    n = cut
            if n >= p.block_size:
                out.add(n)
        return sorted(out)

    def _unfit(self, n: int, last: tuple[int, float] | None, elapsed: float) -> str | None:
        if last is not None:
            p = self.plan
            predicted = last[1] * (n / last[0]) ** GROWTH
            if elapsed + predicted > p.budget_s:
                return f"would take about {predicted:.0f} s, past the time budget ({p.budget_s:.0f} s)"
        return None

    async def _warm_up(self, base: list[int], n: int) -> None:
        """The smallest size once, its timings not counted: the first calls pay for connections and
        first-use costs that no later turn pays, which would read as P's compute. What it finds out of
        the engines (no connector, no handle, a pull P does not make) stands, so a size is not tried
        again where it cannot work."""
        await self._size(n, (base * (n // len(base) + 1))[:n])
        self.s.runs = [r for r in self.s.runs if r.error]  # a failure stands: it is the finding

    # -- one size ------------------------------------------------------------------------------
    async def _size(self, n: int, ids: list[int]) -> None:
        p = self.plan
        self.turns += 1  # every turn its own salts: nothing one cached is found by another
        tag = f"turnkv-doctor-{p.run_id}-{self.turns}"
        before_d = await self.probes.transfers(p.decode)
        t0 = self.clock()
        try:
            pre = await self.engine.prefill(
                p.prefill, self._prefill(ids, f"{tag}-a", None, p.call_timeout_s), CallMeta(f"{tag}-a")
            )
        except UpstreamError as exc:
            return self._failed(n, f"P's prefill failed: {exc}")
        prefill_s = self.clock() - t0
        self._count(prefill=1, tokens=n)
        self.s.p_hands_off = pre.for_decode is not None
        if pre.for_decode is None:  # no KV connector on P: said by the connector finding
            self.s.stop = True
            return self.s.runs.append(SizeRun(n, prefill_s=prefill_s))
        self.s.p_endpoint = self.probes.handle_endpoint(pre.for_decode)
        try:
            answer = await self.engine.decode_json(
                p.decode, self._decode(ids, f"{tag}-a", pre.for_decode), CallMeta(f"{tag}-a"), p.call_timeout_s
            )
        except UpstreamError as exc:  # said by the connector finding
            self.s.push_failed = f"D's answer failed: {exc}"
            self.s.stop = True
            return self.s.runs.append(SizeRun(n, prefill_s=prefill_s))
        self._count(decode=1)
        after_d = await self._settled(p.decode, before_d)
        push = _sample(n, before_d, after_d)
        if before_d is None or after_d is None:
            self._unread(p.decode)
        elif push is None:
            self.s.push_failed = "D counted no transfer of P's KV (it computed the prompt itself: no KV connector?)"
            self.s.stop = True
        else:
            self._count(moved=push.bytes)
        handle = answer.collected.handle
        self.s.d_handle = handle is not None
        run = SizeRun(n, prefill_s=prefill_s, push=push)
        if handle is not None:
            self.s.d_endpoint = self.probes.handle_endpoint(handle)
            run = await self._pull(run, ids, tag, handle)
        self.s.runs.append(run)

    async def _pull(self, run: SizeRun, ids: list[int], tag: str, handle: Handle) -> SizeRun:
        p, n = self.plan, run.tokens
        if self.s.pull not in (PullOutcome.NOT_TRIED, PullOutcome.DONE):
            await self._release(handle)  # P does not pull: the handle is only given back
            return run
        facts = self.engine.read_handle(handle, seq_len=n, block_size=p.block_size)
        held = facts.tokens if isinstance(facts, HandleFacts) else n
        use = min(held, (n - 1) // p.block_size * p.block_size)
        deadline = self._pull_deadline(run)
        before_p = await self.probes.transfers(p.prefill)
        t0 = self.clock()
        try:
            pulled = await self.engine.prefill(
                p.prefill, self._prefill(ids, f"{tag}-b", HandleUse(handle, use), deadline), CallMeta(f"{tag}-b")
            )
        except UpstreamError as exc:
            await self._pull_failed(exc, deadline, before_p)
            await self._release(handle)
            return run
        call_s = self.clock() - t0
        self._count(prefill=1, tokens=n - use)
        after_p = await self._settled(p.prefill, before_p)
        sample = _sample(use, before_p, after_p)
        if before_p is None or after_p is None:
            self._unread(p.prefill)
        self.s.pull = PullOutcome.DONE
        if sample is not None:
            self._count(moved=sample.bytes)
            self.last_pull = (sample.tokens, sample.mean_seconds)
        if pulled.for_decode is not None:  # finish the turn: P holds its blocks for D until D reads them
            await self._finish(ids, f"{tag}-a", pulled.for_decode)
        return replace(run, pull=sample, pull_call_s=call_s)

    def _pull_deadline(self, run: SizeRun) -> float:
        """How long P may take to answer a pull of ``run``'s prompt: ``PULL_DEADLINE_FACTOR`` times the longer
        of what P -> D took for it and what the last pull predicts (the directions can differ a hundredfold)."""
        expect = run.push.mean_seconds if run.push is not None else 1.0
        if self.last_pull is not None:
            expect = max(expect, self.last_pull[1] * run.tokens / self.last_pull[0])
        return max(PULL_DEADLINE_MIN_S, PULL_DEADLINE_FACTOR * expect)

    async def _pull_failed(self, exc: UpstreamError, deadline: float, before: TransferTotals | None) -> None:
        after = await self.probes.transfers(self.plan.prefill)
        tried = after is not None and before is not None and after.failed > before.failed
        if isinstance(exc, UpstreamTimeout):
            self.s.pull = PullOutcome.STALLED
            self.s.pull_detail = (
                f"P did not answer a pull within {deadline:.0f} s: it waits for a read it never starts "
                "(the request was given up, which aborts it)"
            )
        elif tried:
            self.s.pull = PullOutcome.FAILED
            self.s.pull_detail = f"the transfer failed: {exc}"
        elif isinstance(exc, UpstreamStatus):
            self.s.pull = PullOutcome.REFUSED
            self.s.pull_detail = f"P answered a pull with HTTP {exc.upstream_status} and tried no transfer ({exc})"
        else:
            self.s.pull = PullOutcome.FAILED
            self.s.pull_detail = str(exc)

    async def _finish(self, ids: list[int], salt: str, for_decode: Handle) -> None:
        try:
            answer = await self.engine.decode_json(
                self.plan.decode, self._decode(ids, salt, for_decode), CallMeta(salt), self.plan.call_timeout_s
            )
        except UpstreamError:
            return  # P's lease frees its blocks
        self._count(decode=1)
        if answer.collected.handle is not None:
            await self._release(answer.collected.handle)

    async def _release(self, handle: Handle) -> None:
        try:
            await self.engine.release(self.plan.prefill, handle, self.plan.model)
        except UpstreamError:
            self.s.load = replace(self.s.load, left_pinned=self.s.load.left_pinned + 1)
            return
        self.s.load = replace(
            self.s.load, released=self.s.load.released + 1, prefill_requests=self.s.load.prefill_requests + 1
        )

    # -- pieces --------------------------------------------------------------------------------
    def _prefill(self, ids: list[int], salt: str, handle: HandleUse | None, timeout_s: float) -> PrefillCall:
        body = {"model": self.plan.model, "cache_salt": salt}
        return PrefillCall("/v1/completions", body, ids, handle, timeout_s)

    def _decode(self, ids: Sequence[int], salt: str, for_decode: Handle) -> DecodeCall:
        body = {"model": self.plan.model, "prompt": list(ids), "max_tokens": 1, "cache_salt": salt}
        return DecodeCall(
            path="/v1/completions",
            body={k: v for k, v in body.items() if v is not None},
            stream=False,
            track=True,
            for_decode=for_decode,
            prompt_ids=None,
            keep_token_ids=False,
            cached_tokens=None,
        )

    async def _settled(self, base: str, before: TransferTotals | None) -> TransferTotals | None:
        """The engine's totals once they show a new transfer (bounded: an engine's counters can lag)."""
        end = self.clock() + SETTLE_S
        while True:
            now = await self.probes.transfers(base)
            if now is None or before is None or now.count > before.count or self.clock() >= end:
                return now
            await asyncio.sleep(SETTLE_TICK_S)

    def _unread(self, url: str) -> None:
        why = f"{url}'s transfer counters (/metrics) could not be read: its reads were not measured"
        if why not in self.s.skipped:
            self.s.skipped.append(why)

    def _failed(self, n: int, why: str) -> None:
        self.s.runs.append(SizeRun(n, error=why))
        self.s.stop = True

    def _count(self, *, prefill: int = 0, decode: int = 0, tokens: int = 0, moved: float = 0.0) -> None:
        ld = self.s.load
        self.s.load = replace(
            ld,
            prefill_requests=ld.prefill_requests + prefill,
            decode_requests=ld.decode_requests + decode,
            prefilled_tokens=ld.prefilled_tokens + tokens,
            moved_bytes=ld.moved_bytes + moved,
        )


def _sample(tokens: int, before: TransferTotals | None, after: TransferTotals | None) -> Sample | None:
    if before is None or after is None or after.count <= before.count:
        return None
    return Sample(tokens, after.bytes - before.bytes, after.seconds - before.seconds, after.count - before.count)
