"""The SHORTCUT step (gateway/turn/shortcut.py), in process over the fake engine: which turns are planned
without a render, as configured (``Shortcuts``), and that a turn the record proves gets the same plan with
or without its render."""

from __future__ import annotations

from typing import Any

import pytest

from tests.pipeline.harness import Chat, gateway
from turnkv.engine.base import CallMeta
from turnkv.gateway.identity import Conversation
from turnkv.gateway.turn import shortcut
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.shortcut import Shortcuts
from turnkv.reuse.assess import Reason

USER = {"role": "user", "content": "what is the weather like"}


def _turn(messages: list[dict[str, Any]], *, conversation: bool = True, n: int = 1) -> Turn:
    conv = Conversation(tenant="t", session="s", key="k") if conversation else None
    body = {"model": "m", "messages": messages}
    answers = sum(1 for m in messages if m["role"] == "assistant")
    return Turn(request_id="r", body=body, stream=False, meta=CallMeta("r"), conversation=conv, index=1 + answers, n=n)


LATER = [USER, {"role": "assistant", "content": "sunny"}, {"role": "user", "content": "and tomorrow?"}]


@pytest.mark.parametrize(
    ("turn", "plain", "first"),
    [
        (_turn([USER], conversation=False), Reason.NO_SESSION, False),
        (_turn([USER], n=2), Reason.UNSUPPORTED_REQUEST, False),
        (_turn([USER]), None, True),
        (_turn(LATER), None, False),
    ],
)
async def test_which_turns_may_go_without_a_render_as_configured(turn: Turn, plain: Reason | None, first: bool) -> None:
    async with gateway(policy={"name": "adaptive"}) as gw:
        way = shortcut.way(gw.svc, turn)
        assert (way.plain, way.first) == (plain, first)
        # a later turn that continues its answer with text: decode-local and ahead shortcuts both open
        assert way.record_first is (plain is None)
        assert (way.direct, way.ahead) == ((True, True) if turn.index > 1 and plain is None else (False, False))
        # rendered first: a turn with a record to claim is rendered beside the claim, whatever it is; one
        # with nothing to claim goes as the client sent it (how it reaches the engines is theirs)
        render_first = shortcut.way(gw.svc, turn, Shortcuts.RENDER_FIRST)
        assert render_first.plain == plain and not render_first.record_first
        # the settings close the shortcuts they name
        closed = shortcut.way(gw.svc, turn, Shortcuts.of(gw.svc.settings.model_copy(update={"render_ahead": False})))
        assert not closed.ahead


# always-pull: P caches the conversation, which a pull sent ahead of its check (salted) could not use: rendered
@pytest.mark.parametrize(
    ("policy", "unrendered"), [("always-pull", False), ("never-pull", True), ("decode-local", True), ("adaptive", True)]
)
async def test_a_turn_the_record_proves_is_planned_alike_with_or_without_its_render(
    policy: str, unrendered: bool
) -> None:
    # one decision path: the same conversation through a gateway whose shortcuts are closed (every turn
    # rendered, then planned) and one whose are open (planned from the record): the same decisions
    decided: list[list[tuple[str, str, str]]] = []
    for shortcuts in (False, True):
        async with gateway(policy={"name": policy}, render_ahead=shortcuts, decode_local_direct=shortcuts) as gw:
            chat = Chat(gw, session="c1")
            answers = [await chat.say(text) for text in ("Plan a trip.", "And then?", "What should I pack?")]
            assert all(a.status == 200 for a in answers), [a.body for a in answers]
            decided.append([(a.outcome, a.action, a.reason) for a in answers])
            shortcut_taken = [bool(t.get("direct") or t.get("ahead")) for t in gw.turns[1:]]
            assert shortcut_taken == [shortcuts and unrendered] * 2, gw.turns
    assert decided[0] == decided[1]
