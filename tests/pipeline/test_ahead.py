"""A pull sent to P ahead of its token check (gateway/turn/ahead.py), in process over the fake engine: the check
runs on the prompt ids P returns (no render call), or on a render when P says none or when asked to
(``ahead_check``)."""

from __future__ import annotations

import pytest

from tests.pipeline.harness import P0, P1, Chat, Gateway, gateway
from tests.sim_engine import SimEngine
from tests.store_contract import rec
from turnkv.gateway.turn import render
from turnkv.reuse.assess import Reason


async def _second_turn_on_a_new_p(gw: Gateway) -> Chat:
    """A conversation whose next P caches nothing of it (its first P went away): its pulls go ahead."""
    chat = Chat(gw, session="c1")
    assert (await chat.say("what is the weather like")).status == 200
    home = gw.turns[-1]["prefill"]
    gw.engine.faults(home, unreachable=True)
    await gw.wait_for("its P to be marked down", lambda: not _healthy(gw, home))
    return chat


def _healthy(gw: Gateway, url: str) -> bool:
    view = gw.svc.fleet.view(url)
    return view is not None and view.healthy


@pytest.mark.parametrize(
    ("check", "p_ids", "renders"), [("prefill", True, 0), ("prefill", False, 1), ("render", True, 1)]
)
async def test_a_pull_ahead_is_checked_on_the_ids_p_returns_else_on_a_render(
    check: str, p_ids: bool, renders: int
) -> None:
    engine = SimEngine([P0, P1], ["http://d0.fake"])
    async with gateway(engine, prefill=[P0, P1], render=None, ahead_check=check) as gw:
        chat = await _second_turn_on_a_new_p(gw)
        other = P1 if gw.turns[-1]["prefill"] == P0 else P0
        engine.faults(other, no_token_ids=not p_ids)
        before = sum(engine[p].calls.count("render") for p in (P0, P1))
        a = await chat.say("and then?")
        assert a.status == 200, a.body
        assert a.headers["x-turnkv-ahead"] == "checked", gw.turns[-1]
        assert (a.outcome, a.action, a.reason) == ("full", "pull", "full_match")
        assert int(a.headers["x-turnkv-matched-tokens"]) > 0
        assert sum(engine[p].calls.count("render") for p in (P0, P1)) == before + renders


@pytest.mark.parametrize(
    ("tail", "proved", "reason"),
    [([7, 8], True, None), ([7, "8"], False, Reason.RENDER_FAILED), ([7, 2**70], False, Reason.RENDER_FAILED)],
)
async def test_ids_the_records_digest_proves_are_checked_to_be_ints_past_it(
    tail: list[object], proved: bool, reason: Reason | None
) -> None:
    # the digest proves the record's tokens; what P returned past them must still be 64-bit ints, or P's
    # answer is a protocol error, as ids the chain cannot take always were
    record = rec(tokens=40)  # D's sequence: ids 0..39, with their digest
    assert record.tokens_digest is not None
    async with gateway() as gw:
        ids = [*range(40), *tail]
        checked = render.from_prefill(gw.svc, ids, record)
        assert (checked.proved, checked.reason) == (proved, reason)
        assert gw.metric("turnkv_upstream_errors_total", leg="prefill", kind="protocol") == (0 if proved else 1)
