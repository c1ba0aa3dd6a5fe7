"""What the cost model learns of P's prefill time, in process over the fake engine: P's time on a turn's
prefill, not its wait behind this gateway's earlier prefills there (``Slot.served_s``). The call's wall time
counts P's queue in: at a saturated P the estimate learnt from it was 74x P's compute per token, which
priced recomputes and pulls alike by the queue and let noise decide between them (issue 11)."""

from __future__ import annotations

import asyncio

from tests.pipeline.harness import P0, Chat, gateway


async def test_a_turns_prefill_is_learnt_from_when_the_prefill_before_it_left_p() -> None:
    async with gateway() as gw:
        # a long prefill of this gateway's, sent first, in flight on P: P works on it before the turn's
        earlier = gw.svc.fleet.hold(P0, work_s=5.0, tokens=200_000)
        gw.engine.faults(P0, busy=1, leg="prefill")
        turn = asyncio.create_task(Chat(gw, session="c1").say("Summarise the archive. " * 50))
        await gw.wait_for("the turn's prefill behind P's other work", lambda: gw.engine.instances[P0].behind == 1)
        earlier.release()  # it leaves P; P takes the turn's prefill next
        gw.engine.free(P0)
        a = await turn
        assert a.status == 200, a.body
        t = gw.turns[-1]
        # P's time on the turn counts from when the earlier one left, not from when the turn was sent
        assert t["prefill_ms"] > t["prefill_served_ms"] > 0

        # P idle: a turn sent now is served from when it was sent (within the call)
        b = await Chat(gw, session="c2").say("A short question.")
        assert b.status == 200, b.body
        assert 0 < gw.turns[-1]["prefill_served_ms"] <= gw.turns[-1]["prefill_ms"]
