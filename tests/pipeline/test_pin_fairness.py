"""The pin budget of a decode engine shared among tenants: one tenant's many conversations release its own
pins, idle longest first, never another tenant's within its share. In process over the fake engine, with
API keys naming the tenants; every answer checked against a colocated engine's (``Chat``)."""

from __future__ import annotations

from tests.pipeline.harness import D0, Chat, Gateway, gateway

KEYS = ["sk-busy busy", "sk-quiet quiet"]


def chat(gw: Gateway, key: str, session: str) -> Chat:
    return Chat(gw, session=session, headers={"authorization": f"Bearer {key}"})


async def test_a_busy_tenant_releases_its_own_pins_not_a_quiet_tenants() -> None:
    async with gateway(api_keys=KEYS) as gw:
        quiet = chat(gw, "sk-quiet", "q")
        assert (await quiet.say("question number 0 about the weather")).status == 200
        pinned = gw.engine[D0].pinned_tokens  # one conversation's pin
        gw.engine[D0].capacity_tokens = pinned * 8  # a budget (half) of four conversations like it
        await gw.wait_for("the capacity to be read", lambda: gw.svc.pins.capacity(D0) == pinned * 8)
        busy = [chat(gw, "sk-busy", f"b{i}") for i in range(8)]
        for c in busy:  # each pin past the budget releases one: the busy tenant's own, idle longest first
            assert (await c.say("question number 0 about the weather")).status == 200
        await gw.wait_for("the busy tenant's pins to be released", lambda: len(gw.engine[D0].released) >= 4)
        a = await quiet.say("and tomorrow?")  # idle longest of all, within its share: still pinned
        assert (a.outcome, a.action, a.reason) == ("full", "pull", "full_match")
        b = await busy[0].say("and tomorrow?")  # the busy tenant's idle longest: released for its own turns
        assert (b.outcome, b.action, b.reason) == ("none", "recompute", "pin_released")
        assert (await busy[-1].say("and tomorrow?")).reason != "pin_released"  # its newest: kept
