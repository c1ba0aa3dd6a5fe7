"""P's load as the policy sees it, in process over the fake engine.

What the cost model learns of P's prefill time: P's time on a turn's prefill, not its wait behind this
gateway's earlier prefills there (``Slot.served_s``). The call's wall time counts P's queue in: at a
saturated P the estimate learnt from it was 74x P's compute per token, which priced recomputes and pulls
alike by the queue and let noise decide between them. And what P's queue adds to a decision:
each action's P compute charged for the prefills waiting there (``prefill_waiting``, ``charges_ms``)."""

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


async def test_the_prefills_waiting_at_p_are_charged_in_the_decision_and_logged() -> None:
    async with gateway(policy={"name": "adaptive", "params": {"decode_local": False}}) as gw:
        chat = Chat(gw, session="c1")
        assert (await chat.say("Plan the trip. " * 100)).status == 200
        assert (await chat.say("And the way back?")).status == 200
        idle = gw.turns[-1]
        assert idle["load"]["prefill_waiting"] == 0 and "charges_ms" not in idle  # P idle: nothing charged
        held = [gw.svc.fleet.hold(P0, work_s=0.5, tokens=8000) for _ in range(3)]  # this gateway's, in flight
        a = await chat.say("One more stop, please.")
        assert a.status == 200, a.body
        busy = gw.turns[-1]
        assert busy["load"]["prefill_waiting"] == 3
        # each action through P charged its P compute (three times over), beside its TTFT estimate
        charges = busy["charges_ms"]
        assert set(charges) == set(busy["estimates_ms"]) and all(c > 0 for c in charges.values())
        for s in held:
            s.release()
