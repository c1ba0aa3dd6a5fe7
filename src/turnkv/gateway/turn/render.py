"""RENDER: turn the messages into the exact token ids the engines will see, and judge them.

The engine's own render (or a render service) is the authority for tokenization. A render the client caused
to fail is the client's error; a render the engine failed only costs this turn its reuse. The ids are judged
against the claimed record: the usual later turn's start with the record's whole sequence, proved by its
digest in one call (``chain.proves``); otherwise their hash chain is built here, for the token check.
Where no shortcut can apply (``turn.shortcut``), the render runs beside the claim (``beside``). The same
judging serves the check of a pull sent to P ahead of its render (``turn.ahead``): on a render beside P's
leg (``run``), or on the prompt ids P returns (``from_prefill``).
Transition: RENDER → PLAN; a render that failed the turn says so (``failure``), and the driver ends it.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Awaitable

from turnkv.errors import ClientError, UpstreamError, UpstreamStatus
from turnkv.gateway.services import Services
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import Claimed, Rendered
from turnkv.reuse.assess import Reason
from turnkv.reuse.chain import ChainBuilder, proves
from turnkv.state.record import ConversationRecord


async def _render(svc: Services, turn: Turn) -> list[int]:
    return await svc.engine.render(svc.render_base(), turn.body, turn.meta)


async def _ids(svc: Services, turn: Turn) -> list[int] | Exception:
    """The render call's ids, or its failure, to be judged."""
    try:
        return await _render(svc, turn)
    except Exception as exc:
        return exc


async def run(svc: Services, turn: Turn, record: ConversationRecord | None) -> Rendered:
    """Render the turn, and judge its ids against ``record`` (the claimed one, if any)."""
    t0 = time.perf_counter()
    got = await _ids(svc, turn)
    return judge(svc, got, record, time.perf_counter() - t0)


async def beside(svc: Services, turn: Turn, claiming: Awaitable[Claimed]) -> tuple[Claimed, Rendered]:
    """The render and the claim at once; the ids judged against the claimed record."""
    t0 = time.perf_counter()
    got, claimed = await asyncio.gather(_ids(svc, turn), claiming, return_exceptions=True)
    if isinstance(claimed, BaseException):
        raise claimed
    if isinstance(got, BaseException) and not isinstance(got, Exception):
        raise got
    return claimed, judge(svc, got, claimed.record, time.perf_counter() - t0)


def from_prefill(svc: Services, ids: list[int], record: ConversationRecord) -> Rendered:
    """The prompt ids P returned with its answer (``return_token_ids``), judged as a render's: P rendered the
    messages itself, as the render call would have (``turn.ahead`` checks them before D starts)."""
    t0 = time.perf_counter()
    judged = judge(svc, ids, record, 0.0, leg="prefill")
    return Rendered(judged.prompt_ids, judged.chain, judged.proved, time.perf_counter() - t0, judged.reason)


def judge(
    svc: Services,
    got: list[int] | Exception,
    record: ConversationRecord | None,
    seconds: float,
    *,
    leg: str = "render",
) -> Rendered:
    """The render's outcome as the planner takes it: the ids (with what proves or checks them against
    ``record``), or why there are none."""
    if isinstance(got, ClientError) or (isinstance(got, UpstreamStatus) and 400 <= got.upstream_status < 500):
        # the messages themselves are wrong: the client hears the engine's words
        return Rendered(seconds=seconds, reason=Reason.REQUEST_REJECTED, failure=got)
    if isinstance(got, UpstreamError):
        svc.metrics.upstream_error("render", got.kind, got.instance)
        return Rendered(seconds=seconds, reason=Reason.RENDER_FAILED)
    if isinstance(got, Exception):
        return Rendered(seconds=seconds, reason=Reason.RENDER_FAILED, failure=got)
    # the usual later turn: the ids start with the record's whole sequence, proved by its digest in one
    # call; the chain (one hash per block) is then built by CAPTURE, after D has started
    proved = record is not None and proves(record.tokens_digest, record.num_tokens, got)
    proved_tokens = record.num_tokens if proved and record is not None else 0
    try:
        if proved_tokens:
            array("q", got[proved_tokens:])  # the rest are 64-bit ints too (the digest says the first are)
            chain = None
        else:
            chain = ChainBuilder(svc.settings.block_size).extend(got)
    except (TypeError, OverflowError):  # ids that are not integers
        svc.metrics.upstream_error(leg, "protocol", None)
        return Rendered(seconds=seconds, reason=Reason.RENDER_FAILED)
    return Rendered(got, chain, proved_tokens > 0, seconds)
