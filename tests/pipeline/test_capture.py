"""Every capture outcome (what a turn leaves for the next one), the handles it gives back, and the turn's
headers and log event, in process over the fake engine."""

from __future__ import annotations

import pytest

from tests.pipeline.harness import D0, P0, Chat, EditableStore, Gateway, gateway
from tests.sim_engine import SimEngine


async def first_turn(gw: Gateway, *, stream: bool = False, **body: object) -> Chat:
    chat = Chat(gw, session="c1", stream=stream, body=dict(body))
    a = await chat.say("what is the weather like")
    assert a.status == 200, a.body
    return chat


async def test_stored_with_the_handle() -> None:
    async with gateway() as gw:
        chat = await first_turn(gw)
        assert gw.turns[-1]["capture"] == "stored"
        assert len(gw.engine[D0].pins) == 1
        assert gw.metric("turnkv_handle_captures_total", result="stored") == 1
        assert (await chat.say("again")).reason == "full_match"


async def test_a_handle_the_policy_would_not_pull_is_released_at_once() -> None:
    async with gateway(policy={"name": "never-pull"}) as gw:
        await first_turn(gw)
        assert gw.turns[-1]["capture"] == "stored_not_needed"
        await gw.wait_for("the release", lambda: not gw.engine[D0].pins)
        assert gw.metric("turnkv_handle_releases_total", why="not_needed") == 1


async def test_a_decode_local_turn_asks_for_no_handle_and_supersedes_the_claimed_one() -> None:
    async with gateway(policy={"name": "decode-local"}, decode_memory={"pin": "always"}) as gw:
        chat = await first_turn(gw)
        pin = next(iter(gw.engine[D0].pins))
        await chat.say("and then?")
        assert gw.turns[-1]["capture"] == "stored_decode_local"
        await gw.wait_for("the release", lambda: pin in gw.engine[D0].released)
        assert not gw.engine[D0].pins  # D pinned nothing for the decode-local turn
        assert gw.metric("turnkv_handle_releases_total", why="superseded") == 1


async def test_a_stream_without_a_handle() -> None:
    engine = SimEngine([P0], [D0])
    engine.faults(D0, no_handle_in_stream=True)
    async with gateway(engine) as gw:
        await first_turn(gw, stream=True)
        assert gw.turns[-1]["capture"] == "stored_no_handle_in_stream"


async def test_a_stateless_turns_handle_is_released() -> None:
    async with gateway() as gw:
        await Chat(gw).say("hello")
        assert gw.turns[-1]["capture"] == "no_session"
        await gw.wait_for("the release", lambda: not gw.engine[D0].pins)
        assert gw.metric("turnkv_handle_releases_total", why="unused") == 1


async def test_handles_nobody_will_pull_are_left_to_ds_ttl_within_their_share() -> None:
    """As plain P/D leaves them (no release request each), while they hold at most ``unused_share`` of D's
    capacity: past it the oldest is released, and under pressure all of them."""
    async with gateway(policy={"name": "never-pull"}, decode_memory={"unused_share": 0.5}) as gw:
        d = gw.engine[D0]
        d.capacity_tokens = 1_000_000
        await gw.wait_for("the capacity to be read", lambda: gw.svc.pins.capacity(D0) == 1_000_000)
        await first_turn(gw)  # a session turn whose handle the policy would not pull
        assert gw.turns[-1]["capture"] == "stored_not_needed"
        await Chat(gw).say("what is the weather like")  # a stateless turn
        assert gw.turns[-1]["capture"] == "no_session"
        assert len(d.pins) == 2 and not d.released
        assert gw.metric("turnkv_unused_handles_left_total", why="not_needed") == 1
        assert gw.metric("turnkv_unused_handles_left_total", why="unused") == 1
        assert gw.metric("turnkv_handle_releases_total", why="unused") == 0
        assert gw.svc.pins.unused_tokens(D0) == d.pinned_tokens
        oldest = next(iter(d.pins))
        # room for two more like these: the next one pushes the oldest out
        d.capacity_tokens = d.pinned_tokens * 2
        await gw.wait_for("the capacity to be read", lambda: gw.svc.pins.capacity(D0) == d.capacity_tokens)
        await Chat(gw).say("what is the weather like")
        await gw.wait_for("the oldest to be released", lambda: d.released == [oldest])
        assert len(d.pins) == 2 and gw.metric("turnkv_handle_releases_total", why="not_needed") == 1
        d.kv_usage = 0.95  # pressure: every handle nobody will pull goes first
        await gw.wait_for("the rest to be released", lambda: not d.pins)
        assert gw.metric("turnkv_handle_releases_total", why="unused") == 2
        assert gw.svc.pins.unused_tokens(D0) == 0


@pytest.mark.parametrize(
    ("fault", "outcome"),
    [
        ({"no_token_ids": True}, "no_token_ids"),
        ({"no_handle": True}, "no_handle"),
        ({"bad_handle": "not_a_decode_handle"}, "not_a_decode_handle"),
        ({"bad_handle": "inconsistent_handle"}, "inconsistent_handle"),
        ({"bad_handle": "incomplete_handle"}, "incomplete_handle"),
    ],
)
async def test_an_answer_that_cannot_be_kept(fault: dict[str, object], outcome: str) -> None:
    engine = SimEngine([P0], [D0])
    engine.faults(D0, **fault)
    async with gateway(engine) as gw:
        chat = await first_turn(gw)
        assert gw.turns[-1]["capture"] == outcome
        await gw.wait_for("D's handle to be released", lambda: not engine[D0].pins)
        engine.faults(D0, no_token_ids=False, no_handle=False, bad_handle=None)
        assert (await chat.say("again")).reason == "no_record"


async def test_a_stream_that_breaks_after_its_first_token_fails_the_turn() -> None:
    async with gateway() as gw:
        chat = await first_turn(gw, stream=True)
        gw.engine.faults(D0, drop=1, drop_after=3)
        a = await chat.say("and then?")
        assert a.error is not None and a.error["code"] == "upstream_protocol_error"
        assert gw.turns[-1]["capture"] == "failed_kept_unpinned"  # P had pulled: the record goes back without it
        assert gw.metric("turnkv_upstream_errors_total", leg="decode", kind="stream") == 1


async def test_a_turn_refused_before_p_used_the_handle_keeps_the_record() -> None:
    async with gateway() as gw:
        chat = await first_turn(gw)
        image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}
        a = await gw.chat([*chat.messages, image], session="c1")
        assert a.status == 400  # the engine's render refused it: the client hears the engine's words
        assert gw.turns[-1]["capture"] == "failed_kept_previous"
        assert (await chat.say("never mind")).reason == "full_match"


async def test_a_store_that_fails_on_put_releases_the_new_handle() -> None:
    store = EditableStore()
    async with gateway(store=store) as gw:
        store.failing.add("put")
        await first_turn(gw)
        assert gw.turns[-1]["capture"] == "store_unavailable"
        await gw.wait_for("the release", lambda: not gw.engine[D0].pins)
        assert gw.metric("turnkv_handle_releases_total", why="store_unavailable") == 1


# -- the turn's headers and log event: clients, the benchmark and the dashboard read them ------------
BASIC = {"x-request-id", "x-turnkv-outcome", "x-turnkv-action", "x-turnkv-reason", "x-turnkv-conversation"}
FULL = BASIC | {
    "x-turnkv-matched-tokens",
    "x-turnkv-prompt-tokens",
    "x-turnkv-planned-pull-tokens",
    "x-turnkv-prefill-cached-tokens",
    "x-turnkv-prefill-ms",
}
LOGGED = {
    "request_id",
    "conversation",
    "turn",
    "outcome",
    "action",
    "reason",
    "matched_tokens",
    "tokens_planned_pull",
    "admission_ms",
    "tokens_cached",
    "tokens_computed",
    "prompt_tokens",
    "generated_tokens",
    "prefill",
    "decode",
    "render_ms",
    "planned_ms",
    "prefill_ms",
    "prefill_served_ms",
    "capture",
    "conversation_source",
    "event",
    "level",
    "timestamp",
}


def ours(headers: object) -> set[str]:
    return {k for k in headers if k.startswith("x-")}  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True])
async def test_headers_and_log_of_a_pull(stream: bool) -> None:
    async with gateway() as gw:
        chat = await first_turn(gw, stream=stream)
        a = await chat.say("again")
        assert ours(a.headers) == FULL
        # what the planner told the policy of the engines' load (reuse.load) is logged with every planned turn
        assert set(gw.turns[-1]) == LOGGED | {"load"} | ({"ttft_ms"} if stream else set())
        assert a.headers["x-turnkv-conversation"] == "header"


@pytest.mark.parametrize(
    ("policy", "logged"), [("decode-local", {"direct", "load"}), ("adaptive", {"direct", "estimates_ms", "load"})]
)
async def test_headers_and_log_of_a_direct_decode_local_turn(policy: str, logged: set[str]) -> None:
    async with gateway(policy={"name": policy}) as gw:
        chat = await first_turn(gw)
        a = await chat.say("again")
        assert a.action == "decode_local"
        # not rendered, not prefilled: no token counts but the pull's
        assert ours(a.headers) == (
            FULL
            - {
                "x-turnkv-prefill-ms",
                "x-turnkv-prefill-cached-tokens",
                "x-turnkv-matched-tokens",
                "x-turnkv-prompt-tokens",
            }
        ) | {"x-turnkv-direct"}
        assert set(gw.turns[-1]) == (LOGGED - {"prefill_served_ms"}) | logged  # P served nothing


async def test_headers_and_log_of_a_stateless_turn_with_basic_headers() -> None:
    async with gateway(decision_headers="basic") as gw:
        a = await Chat(gw).say("hello")
        assert ours(a.headers) == BASIC
        assert a.headers["x-turnkv-conversation"] == "none"
        assert set(gw.turns[-1]) == LOGGED - {"conversation", "conversation_source"}


@pytest.mark.parametrize(("hedge", "capture"), [(True, "stored_hedge"), (False, "stored_not_needed")])
async def test_a_handle_is_kept_as_a_hedge_where_a_pull_beats_p_recomputing_the_history(
    hedge: bool, capture: str
) -> None:
    """D is idle and would take the next turn itself, P's cache holds the history: no pull is expected. But
    should D not have room then and P's cache have lost the history, pulling the long history over a fast
    link beats recomputing it on P: the handle stays pinned, and the capture says why."""
    policy = {"name": "adaptive", "params": {"keep_hedge": hedge}}
    async with gateway(policy=policy, costs={"link_gbps": 300.0}) as gw:
        a = await Chat(gw, session="c1").say(" ".join(f"word{i}" for i in range(3000)))  # a long history
        assert a.status == 200, a.body
        assert gw.turns[-1]["capture"] == capture
        assert gw.metric("turnkv_handle_captures_total", result=capture) == 1
        # the store counts a kept handle against D's pin budget; a dropped one is not the conversation's
        d = gw.svc.fleet.view(D0)
        assert d is not None and (d.pinned_tokens > 0) is hedge
