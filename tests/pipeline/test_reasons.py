"""Every reason code a turn can give, each from the situation that causes it, in process over the fake
engine. Every answer is checked against a colocated engine's (``Chat`` does it): a reason is never
bought with a wrong answer."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tests.pipeline.harness import D0, D1, P0, Chat, EditableStore, Gateway, gateway
from tests.sim_engine import SimEngine
from turnkv.routing import InstanceView


def view(gw: Gateway, url: str) -> InstanceView:
    v = gw.svc.fleet.view(url)
    assert v is not None
    return v


async def conversation(gw: Gateway, turns: int = 1, *, stream: bool = False, session: str = "c1") -> Chat:
    chat = Chat(gw, session=session, stream=stream)
    for i in range(turns):
        a = await chat.say(f"question number {i} about the weather")
        assert a.status == 200, a.body
    return chat


async def test_full_match_pulls_all_of_ds_kv() -> None:
    async with gateway() as gw:
        chat = await conversation(gw)
        a = await chat.say("and tomorrow?")
        assert (a.outcome, a.action, a.reason) == ("full", "pull", "full_match")
        matched, pulled = int(a.headers["x-turnkv-matched-tokens"]), int(a.headers["x-turnkv-planned-pull-tokens"])
        assert 0 < pulled <= matched  # what P's own prefix cache lacks


async def test_no_session_is_plain_pd() -> None:
    async with gateway() as gw:
        a = await Chat(gw).say("hello")
        assert (a.outcome, a.action, a.reason) == ("stateless", "recompute", "no_session")
        assert gw.turns[-1]["capture"] == "no_session"


async def test_a_first_turn_with_nothing_stored_is_not_rendered() -> None:
    async with gateway() as gw:
        renders = gw.engine[P0].calls.count("render")  # the template audit's
        a = await Chat(gw, session="new").say("hello")
        assert (a.outcome, a.reason) == ("none", "no_record")
        assert gw.engine[P0].calls.count("render") == renders


async def test_a_later_turn_of_an_unknown_conversation_is_rendered_and_finds_nothing() -> None:
    async with gateway() as gw:
        chat = await conversation(gw, session="a")
        chat.session = "b"  # the same history under another id
        renders = gw.engine[P0].calls.count("render")
        a = await chat.say("go on")
        assert (a.outcome, a.reason) == ("none", "no_record")
        assert gw.engine[P0].calls.count("render") == renders + 1


async def test_a_turn_while_another_holds_the_record_is_concurrent() -> None:
    async with gateway(timeouts={"prefill_first_token_s": 0.3}) as gw:
        chat = await conversation(gw)
        messages = [*chat.messages, {"role": "user", "content": "first"}]
        gw.engine.faults(P0, hang=1, leg="prefill")  # the first turn's pull waits: it holds the record meanwhile
        first = asyncio.create_task(gw.chat(messages, session="c1"))
        await gw.wait_for("the first turn at P", lambda: gw.engine[P0].calls.count("prefill") == 2)
        second = await gw.chat([*chat.messages, {"role": "user", "content": "second"}], session="c1")
        assert (second.outcome, second.reason) == ("none", "concurrent_turn")
        assert (await first).reason == "first_token_deadline"  # its pull stalled: run again without it


@pytest.mark.parametrize("failing", ["claim", "all"])
async def test_a_store_that_fails_costs_the_turn_its_reuse_only(failing: str) -> None:
    store = EditableStore()
    async with gateway(store=store) as gw:
        chat = await conversation(gw)
        store.failing.add(failing)
        a = await chat.say("still there?")
        assert (a.outcome, a.reason) == ("none", "store_unavailable")
        assert gw.metric("turnkv_redis_errors_total", op="claim", kind="error") == 1


@pytest.mark.parametrize("first", [True, False])
async def test_a_busy_store_costs_that_turn_its_reuse_and_is_not_taken_for_down(first: bool) -> None:
    # every store connection in use: load, not an outage. The turn runs without its record and says why;
    # the guard stays closed, so the next turn finds the record this one stored
    store = EditableStore()
    async with gateway(store=store) as gw:
        chat = Chat(gw, session="c1") if first else await conversation(gw)
        store.busy.add("claim")
        a = await chat.say("still there?")
        assert a.status == 200 and (a.outcome, a.action, a.reason) == ("none", "recompute", "store_busy")
        assert gw.turns[-1]["reason"] == "store_busy"
        assert gw.metric("turnkv_store_busy_total", op="claim") == 1
        assert gw.metric("turnkv_redis_errors_total", op="claim", kind="error") == 0
        assert gw.metric("turnkv_store_up") == 1
        store.busy.clear()
        a = await chat.say("and now?")
        assert (a.outcome, a.reason) == ("full", "full_match")


async def test_a_failed_render_runs_the_turn_as_plain_pd_and_releases_the_handle() -> None:
    render = "http://render.fake"
    engine = SimEngine([P0, render], [D0])
    async with gateway(engine, render=render) as gw:
        chat = await conversation(gw)
        pin = next(iter(engine[D0].pins))
        engine.faults(render, fail=1)
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", "render_failed")
        assert pin in engine[D0].released  # P freed it on the way
        assert gw.metric("turnkv_upstream_errors_total", leg="render", kind="status") == 1


async def test_a_render_the_client_caused_to_fail_is_its_4xx_logged_as_request_rejected() -> None:
    async with gateway() as gw:
        chat = await conversation(gw)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        bad = await gw.chat([*chat.messages, {"role": "user", "content": [image]}], session="c1")
        assert bad.status == 400, bad.body
        assert gw.turns[-1]["reason"] == "request_rejected"
        a = await chat.say("go on")  # the record was put back
        assert (a.outcome, a.reason) == ("full", "full_match")


async def test_more_than_one_choice_is_not_tracked() -> None:
    async with gateway() as gw:
        chat = await conversation(gw)
        a = await chat.say("two answers please", n=2)
        assert (a.outcome, a.reason) == ("none", "unsupported_request")


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda r: dataclasses.replace(r, expires_at=time.time() - 1), "expired"),
        (lambda r: dataclasses.replace(r, tenant="someone-else"), "tenant"),
        (lambda r: dataclasses.replace(r, block_size=r.block_size * 2), "block_size_changed"),
    ],
)
async def test_a_record_that_cannot_serve_the_turn(edit: object, reason: str) -> None:
    store = EditableStore()
    async with gateway(store=store) as gw:
        chat = await conversation(gw)
        store.edit = edit  # type: ignore[assignment]
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", reason)


async def test_a_restarted_decode_engine_holds_nothing() -> None:
    async with gateway() as gw:
        # the record keeps the epoch the fleet has read by then: the check needs one to compare
        await gw.wait_for("D's epoch to be read", lambda: view(gw, D0).epoch is not None)
        chat = await conversation(gw)
        gw.engine.restart(D0)
        epoch = gw.engine[D0].epoch
        await gw.wait_for("the restart to be seen", lambda: view(gw, D0).epoch == epoch)
        a = await chat.say("go on")
        assert (a.outcome, a.reason) == ("none", "engine_restarted")
        assert gw.metric("turnkv_engine_restarts_total", role="decode") == 1


async def test_an_engine_restarted_on_another_gpu_is_read_again() -> None:
    # shared_gpu auto: P and D said GPU-0; D comes back on GPU-1 (a reschedule): the gateway reads /version
    # again after the restart and stops taking the pair as sharing a GPU
    engine = SimEngine([P0], [D0])
    engine[P0].gpus = engine[D0].gpus = frozenset({"GPU-0"})
    async with gateway(engine) as gw:
        # the fleet must know D's process (its epoch, from a metrics reading) before it can see it restart
        known = engine[D0].epoch
        await gw.wait_for(
            "D's GPU and process read", lambda: view(gw, D0).gpus == {"GPU-0"} and view(gw, D0).epoch == known
        )
        engine[D0].gpus = frozenset({"GPU-1"})
        engine.restart(D0)
        await gw.wait_for("D's GPU read again after its restart", lambda: view(gw, D0).gpus == {"GPU-1"})
        ready = (await gw.client.get("/ready")).json()
        assert ready["shared_gpu"] == {"setting": "auto", "pairs": []}
        assert {e["url"]: e["gpus"] for e in ready["decode"]} == {D0: ["GPU-1"]}


async def test_an_unhealthy_decode_engine_is_left_for_another() -> None:
    engine = SimEngine([P0], [D0, D1])
    async with gateway(engine, decode=[D0, D1]) as gw:
        chat = await conversation(gw)
        holder = gw.turns[-1]["decode"]
        engine.faults(holder, unreachable=True)
        await gw.wait_for("the engine to be marked down", lambda: not view(gw, holder).healthy)
        a = await chat.say("go on")
        assert (a.outcome, a.reason) == ("none", "decode_unavailable")
        assert gw.turns[-1]["decode"] != holder


@pytest.mark.parametrize("routing", ["load-affinity", "affinity"])
async def test_a_conversation_whose_decode_engine_is_queued_moves_to_the_other(routing: str) -> None:
    # with load-affinity, a D on which requests wait (here 400 ms, as its queue-time histogram
    # says) over 100 ms longer than on the other loses the conversation: the turn pulls the old D's blocks
    # through P and decodes on the other D, and says why. Plain affinity does not look at D's queue.
    engine = SimEngine([P0], [D0, D1])
    async with gateway(engine, decode=[D0, D1], routing=routing) as gw:
        chat = await conversation(gw)
        holder = gw.turns[-1]["decode"]
        other = D1 if holder == D0 else D0
        engine[holder].waiting, engine[holder].queue_ms = 6, 400.0
        await gw.wait_for("the fleet to see the queue", lambda: view(gw, holder).queue_wait_ms is not None)
        a = await chat.say("go on")
        if routing == "affinity":
            assert gw.turns[-1]["decode"] == holder and a.reason == "full_match"
            return
        assert (a.outcome, a.action, a.reason) == ("full", "pull", "decode_moved")
        assert gw.turns[-1]["decode"] == other and engine[holder].released == [] and engine[holder].pins == {}
        assert gw.metric("turnkv_reuse_decisions_total", outcome="full", action="pull", reason="decode_moved") == 1
        engine[holder].waiting = 0
        a = await chat.say("and then?")  # the conversation lives on the other D now
        assert gw.turns[-1]["decode"] == other and (a.outcome, a.reason) == ("full", "full_match")


async def test_an_edited_history_is_refused() -> None:
    async with gateway() as gw:
        chat = await conversation(gw, 2)
        chat.messages[0]["content"] = "a different first question"
        a = await chat.say("go on")
        assert a.reason == "history_edited"
        assert a.outcome in ("partial", "none")


async def test_a_client_that_drops_the_reasoning() -> None:
    async with gateway() as gw:
        chat = await conversation(gw)
        assert "reasoning" in chat.messages[-1]
        del chat.messages[-1]["reasoning"]
        a = await chat.say("go on")
        assert (a.outcome, a.reason) == ("partial", "client_dropped_reasoning")


TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}}},
    }
]


async def test_a_client_that_sends_tool_calls_back_as_text() -> None:
    async with gateway() as gw:
        chat = Chat(gw, session="c1", body={"tools": TOOLS})
        for i in range(8):  # the engine is deterministic: some answer calls the tool
            a = await chat.say(f"look up topic {i}")
            assert a.status == 200
            if chat.messages[-1].get("tool_calls"):
                break
        call = chat.messages[-1].pop("tool_calls")[0]["function"]
        chat.messages[-1]["content"] = f"Calling {call['name']} with {call['arguments']}"  # as smolagents does
        a = await chat.say("and the result?")
        assert a.reason == "answer_as_text" or a.headers.get("x-turnkv-divergence") == "answer_as_text"


async def test_a_template_that_drops_the_reasoning_is_trimmed_to_what_matches() -> None:
    engine = SimEngine([P0], [D0], template="strip")
    async with gateway(engine) as gw:
        chat = await conversation(gw)
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("partial", "pull", "reasoning_stripped")
        assert 0 < int(a.headers["x-turnkv-matched-tokens"]) < int(a.headers["x-turnkv-prompt-tokens"])


async def test_an_edited_answer_is_refused() -> None:
    async with gateway() as gw:
        chat = await conversation(gw)
        chat.messages[-1]["content"] = "Something else entirely."
        a = await chat.say("go on")
        assert a.reason == "answer_edited"


async def test_an_answer_that_tokenizes_differently_when_sent_back() -> None:
    async with gateway(SimEngine([P0], [D0], drift=True)) as gw:
        chat = Chat(gw, session="c1")
        seen = set()
        for i in range(6):
            a = await chat.say(f"question {i}")
            seen.add(a.reason)
            if a.reason == "retokenized":
                assert a.outcome == "partial"
                break
        assert "retokenized" in seen, seen


async def test_a_truncated_history_is_shorter_than_ds() -> None:
    async with gateway() as gw:
        chat = await conversation(gw, 2)
        chat.messages = chat.messages[:1]
        a = await chat.send()
        assert (a.outcome, a.reason) == ("partial", "prompt_shorter")


async def test_the_policy_may_prefer_recomputing() -> None:
    async with gateway(policy={"name": "never-pull"}) as gw:
        chat = await conversation(gw)
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", "cheaper_to_recompute")


@pytest.mark.parametrize("direct", [True, False])
async def test_decode_local(direct: bool) -> None:
    async with gateway(policy={"name": "decode-local"}, decode_local_direct=direct) as gw:
        chat = await conversation(gw)
        renders = gw.engine[P0].calls.count("render")
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("decode_local", "decode_local", "decode_local")
        assert (a.headers.get("x-turnkv-direct") == "true") is direct
        assert (gw.engine[P0].calls.count("render") == renders) is direct  # direct: no render call
        assert "x-turnkv-prefill-ms" not in a.headers


async def test_decode_local_that_would_slow_the_streams_on_d_past_the_itl_budget_goes_through_p() -> None:
    # D runs streams; prefilling the turn there would stretch their steps past a 1 ms budget
    async with gateway(policy={"name": "adaptive", "params": {"itl_budget_ms": 1.0}}) as gw:
        chat = await conversation(gw)
        gw.engine[D0].running = 8
        await gw.wait_for("the fleet to see D's streams", lambda: view(gw, D0).busy >= 8)
        a = await chat.say("go on")
        gw.engine[D0].running = 0
        assert a.action != "decode_local" and a.reason == "itl_budget"


@pytest.mark.parametrize(
    ("headroom", "shared", "gpus", "reason"),
    [
        (0.10, False, None, "itl_headroom"),
        (None, False, None, "decode_local"),
        (0.10, True, None, "shared_gpu"),
        (0.10, "auto", ("GPU-0", "GPU-0"), "shared_gpu"),
        (0.10, "auto", ("GPU-0", "GPU-1"), "itl_headroom"),
        (0.10, "auto", ("", "GPU-0"), "itl_headroom"),
    ],
    ids=["headroom", "no_headroom", "shared_gpu", "auto_one_gpu", "auto_two_gpus", "auto_p_unknown"],
)
async def test_decode_local_that_would_lengthen_ds_step_past_its_headroom_goes_through_p(
    headroom: float | None, shared: bool | str, gpus: tuple[str, str] | None, reason: str
) -> None:
    # D runs streams and would prefill a 600-word turn in one step (no --long-prefill-token-threshold): that
    # step would be far more than 10% longer than D's step alone, though no absolute budget is set.
    # A short turn adds only its attention, well within: it stays decode-local either way. With P on D's GPU
    # (the setting shared_gpu, or with auto the engines naming the same GPU) the path through P would compute
    # the same new words and more there: decode-local.
    engine = SimEngine([P0], [D0])
    for url, gpu in zip((P0, D0), gpus or ("", ""), strict=True):
        engine[url].gpus = frozenset({gpu} - {""})
    params = {"itl_headroom": headroom}
    async with gateway(engine, policy={"name": "adaptive", "params": params}, shared_gpu=shared) as gw:
        chat = await conversation(gw)
        gw.engine[D0].running = 8
        await gw.wait_for("the fleet to see D's streams", lambda: view(gw, D0).busy >= 8)
        assert view(gw, P0).gpus == engine[P0].gpus and view(gw, D0).gpus == engine[D0].gpus
        assert (await chat.say("go on")).action == "decode_local"
        a = await chat.say(" ".join(f"word{i}" for i in range(600)))
        gw.engine[D0].running = 0
        assert a.reason == reason and (a.action == "decode_local") is (reason != "itl_headroom")
        refused = gw.metric("turnkv_reuse_decisions_total", outcome=a.outcome, action=a.action, reason="itl_headroom")
        assert refused == (1 if reason == "itl_headroom" else 0)
        load = gw.turns[-1]["load"]
        assert load["decode_prefills"] == 0  # no other decode-local turn prefilling on D
        assert load["shared_gpu"] is (reason == "shared_gpu")
        told = "setting" if shared != "auto" else "engines" if all(gpus or ()) else "auto:gpus_unknown"
        assert load["sources"]["shared_gpu"] == told


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    ("load", "why"),
    [({"waiting": 2}, "decode_queue"), ({"kv_usage": 0.95}, "decode_busy")],
    ids=["queue_longer_than_ps", "kv_full"],
)
async def test_a_decode_engine_short_of_kv_or_queued_longer_than_p_takes_no_decode_local_turn(
    direct: bool, load: dict[str, float], why: str
) -> None:
    # short of KV, its idle conversations' freed blocks are the first it evicts: a decode-local turn would
    # compute the whole history again there. Requests waiting on D while P is idle: the turn would wait
    # longer on D than at P. The turn goes through P, and says why.
    async with gateway(policy={"name": "decode-local"}, decode_local_direct=direct) as gw:
        chat = await conversation(gw)
        for k, v in load.items():
            setattr(gw.engine[D0], k, v)
        await gw.wait_for(
            "the fleet to see D's load", lambda: view(gw, D0).waiting == 2 or view(gw, D0).kv_usage >= 0.95
        )
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", why)
        assert "x-turnkv-direct" not in a.headers and gw.turns[-1]["prefill"] == P0
        assert gw.turns[-1]["load"]["decode_room"]["state"] == ("queue_longer" if why == "decode_queue" else "busy")
        assert gw.metric("turnkv_reuse_decisions_total", outcome="none", action="recompute", reason=why) == 1
        gw.engine[D0].waiting, gw.engine[D0].kv_usage = 0, None
        await gw.wait_for("D to have room again", lambda: view(gw, D0).waiting == 0 and view(gw, D0).kv_usage < 0.9)
        a = await chat.say("and now?")
        assert (a.outcome, a.action, a.reason) == ("decode_local", "decode_local", "decode_local")


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("local_queue", ["weigh", "refuse"])
async def test_a_decode_engine_queued_less_than_p_still_takes_the_turn_decode_local(
    direct: bool, local_queue: str
) -> None:
    # requests wait on D (20 ms each, as its queue-time histogram says), but P has others'
    # prefills queued (4 of 300 ms): the turn would wait longer at P, so D takes it. With
    # decode_memory.local_queue: refuse (as before), any request waiting on D refuses it.
    async with gateway(
        policy={"name": "decode-local"}, decode_local_direct=direct, decode_memory={"local_queue": local_queue}
    ) as gw:
        chat = await conversation(gw)
        gw.engine[D0].waiting, gw.engine[D0].queue_ms = 3, 20.0
        gw.engine[P0].waiting, gw.engine[P0].prefill_ms = 4, 300.0
        await gw.wait_for(
            "the fleet to see both queues",
            lambda: view(gw, D0).queue_wait_ms is not None and view(gw, P0).prefill_request_ms is not None,
        )
        a = await chat.say("go on")
        if local_queue == "refuse":
            assert (a.action, a.reason) == ("recompute", "decode_queue")
            return
        assert (a.outcome, a.action, a.reason) == ("decode_local", "decode_local", "decode_local")
        room = gw.turns[-1]["load"]["decode_room"]
        assert room["state"] == "queued" and 0 < room["decode_queue_ms"] < room["prefill_queue_ms"]
        gw.engine[P0].waiting = 0  # P's queue gone: D's is the longer one now
        await gw.wait_for("the fleet to see P idle", lambda: view(gw, P0).waiting == 0)
        a = await chat.say("and now?")
        assert (a.action, a.reason) == ("recompute", "decode_queue")


async def test_a_pull_that_fails_is_run_again_without_the_handle() -> None:
    async with gateway() as gw:
        chat = await conversation(gw)
        gw.engine[D0].pins.clear()  # D let the blocks go: P cannot pull them
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", "pull_failed")
        assert gw.turns[-1]["retries"] == ["prefill_pull_failed"]
        assert gw.metric("turnkv_retries_total", leg="prefill", reason="pull_failed") == 1


async def test_a_handle_given_back_for_memory_says_so() -> None:
    async with gateway() as gw:
        first = await conversation(gw, session="a")
        pinned = gw.engine[D0].pinned_tokens
        gw.engine[D0].capacity_tokens = pinned * 3  # a budget of 1.5 conversations like this one
        await gw.wait_for("the capacity to be read", lambda: view(gw, D0).capacity_tokens == pinned * 3)
        await conversation(gw, session="b")  # its pin crosses the budget: the idle one goes
        await gw.wait_for("a's pin to be released", lambda: len(gw.engine[D0].released) == 1)
        d = view(gw, D0)  # what routing sees of it
        assert d.pin_budget_tokens == int(pinned * 3 * 0.5) and 0 < d.pinned_tokens <= d.pin_budget_tokens
        a = await first.say("go on")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", "pin_released")


async def test_a_stream_without_ds_handle() -> None:
    engine = SimEngine([P0], [D0])
    engine.faults(D0, no_handle_in_stream=True)
    async with gateway(engine) as gw:
        chat = await conversation(gw, stream=True)
        assert gw.turns[-1]["capture"] == "stored_no_handle_in_stream"
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", "no_handle_in_stream")


async def test_a_decode_engine_past_its_first_token_deadline() -> None:
    async with gateway(timeouts={"decode_first_token_s": 0.5}) as gw:
        chat = await conversation(gw, stream=True)
        gw.engine.faults(D0, stall=1)
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("full", "pull", "full_match")  # headers went out first
        assert a.done and a.error is None
        t = gw.turns[-1]
        assert (t["outcome"], t["action"], t["reason"]) == ("none", "recompute", "first_token_deadline")
        assert t["retries"] == ["decode_first_token_deadline", "turn_rerun"]
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg="decode") == 1


async def test_a_prefill_engine_past_its_first_token_deadline_on_a_pull() -> None:
    async with gateway(timeouts={"prefill_first_token_s": 0.2}) as gw:
        chat = await conversation(gw)
        gw.engine.faults(P0, hang=1, leg="prefill")
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", "first_token_deadline")
        assert gw.turns[-1]["retries"] == ["prefill_first_token_deadline"]
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg="prefill") == 1
        # given up on, perhaps in P's queue: vLLM told D nothing, so the handle is released on its own
        assert gw.metric("turnkv_handle_releases_total", why="prefill_failed") == 1


@pytest.mark.parametrize("fault", [{"drop": 1, "drop_after": 0}, {"error": 1}])
async def test_a_decode_engine_that_fails_before_its_first_token(fault: dict[str, int]) -> None:
    async with gateway() as gw:
        chat = await conversation(gw, stream=True)
        gw.engine.faults(D0, **fault)
        a = await chat.say("go on")
        assert a.done and a.error is None
        t = gw.turns[-1]
        assert (t["outcome"], t["action"], t["reason"]) == ("none", "recompute", "decode_failed")
        assert t["retries"] == ["turn_rerun"]


@pytest.mark.parametrize("first_on_d", [True, False])
async def test_a_first_turn_runs_on_d_while_p_has_seconds_of_prefills_queued(first_on_d: bool) -> None:
    policy = {"name": "adaptive", "params": {"decode_local_first": first_on_d}}
    async with gateway(policy=policy) as gw:
        # P idle: through P, even though D alone would be faster for so short a prompt (no transfer)
        idle = await Chat(gw, session="c1").say("Plan a short trip to the coast.")
        assert (idle.action, idle.reason) == ("recompute", "no_record")
        held = gw.svc.fleet.hold(P0, work_s=5.0, tokens=200_000)  # seconds of this gateway's work on P
        chat = Chat(gw, session="c2")
        a = await chat.say("Plan a long trip to the mountains.")  # checked against a colocated engine's answer
        assert a.status == 200, a.body
        t = gw.turns[-1]
        if first_on_d:
            # D prefills the whole prompt itself, as colocated serving does; nothing went to P
            assert (a.action, a.reason, t["turn"], t["prefill_ms"]) == ("decode_local", "prefill_busy", 1, 0.0)
            assert t["estimates_ms"]["decode_local"] < t["estimates_ms"]["recompute"]
            assert t["load"]["prefill_waiting"] == 1
        else:
            assert (a.action, a.reason) == ("recompute", "no_record")
        held.release()
        b = await chat.say("And what should I pack?")  # the conversation goes on from what D computed
        assert b.status == 200, b.body


async def test_many_first_turns_at_once_on_a_busy_p_and_a_small_d_are_all_answered_right() -> None:
    # twelve conversations start together while P has seconds of work in flight; D holds the pins of a few
    # of them only. Some first turns run on D, the rest through P; every answer equals a colocated
    # engine's (``Chat``), and the conversations go on, whichever engine computed their first turn.
    async with gateway(policy={"name": "adaptive", "params": {"decode_local_first": True}}) as gw:
        sizing = await conversation(gw, session="sizing")
        gw.engine[D0].capacity_tokens = gw.engine[D0].pinned_tokens * 6  # pins of about three conversations
        await gw.wait_for("D's capacity to be read", lambda: view(gw, D0).capacity_tokens is not None)
        held = gw.svc.fleet.hold(P0, work_s=5.0, tokens=200_000)
        chats = [Chat(gw, session=f"many{i}") for i in range(12)]
        firsts = await asyncio.gather(*(c.say(f"Plan trip number {i}.") for i, c in enumerate(chats)))
        assert all(a.status == 200 and a.error is None for a in firsts), [a.body for a in firsts]
        assert {a.reason for a in firsts} <= {"prefill_busy", "no_record"}
        assert any(a.reason == "prefill_busy" for a in firsts)
        held.release()
        for _ in range(2):
            later = await asyncio.gather(*(c.say("And then?") for c in [sizing, *chats]))
            assert all(a.status == 200 and a.error is None for a in later), [a.body for a in later]
        d, share = view(gw, D0), gw.svc.settings.decode_memory.pin_budget_share
        assert d.capacity_tokens is not None and gw.engine[D0].pinned_tokens <= d.capacity_tokens * share


@pytest.mark.parametrize("told", [True, False], ids=["setting", "auto_from_the_engines"])
async def test_many_long_turns_at_once_on_a_shared_gpu_are_all_answered_right(told: bool) -> None:
    # P on D's GPU (the setting shared_gpu, or left at auto with both engines naming the same GPU), D running
    # streams, its KV sized for the pins of about six conversations: thirteen send long turns together, which
    # the headroom alone would send through P. Some run on D as shared_gpu; the others go where the policy
    # puts them (itl_headroom where P would compute less). Every answer equals a colocated engine's (``Chat``),
    # the conversations go on, and D's pins stay within their budget. The stall limit is lifted: the ITL
    # checks are what is under test, and what the fake P taught the estimate must not decide it.
    policy = {"name": "adaptive", "params": {"decode_local_max_stall_ms": 100_000}}
    engine = SimEngine([P0], [D0])
    if not told:
        engine[P0].gpus = engine[D0].gpus = frozenset({"GPU-0"})
    async with gateway(engine, policy=policy, shared_gpu=True if told else "auto") as gw:
        sizing = await conversation(gw, session="sizing")
        gw.engine[D0].capacity_tokens = gw.engine[D0].pinned_tokens * 12
        chats = [Chat(gw, session=f"long{i}") for i in range(12)]
        firsts = await asyncio.gather(*(c.say(f"Plan trip number {i}.") for i, c in enumerate(chats)))
        assert all(a.status == 200 and a.error is None for a in firsts), [a.body for a in firsts]
        gw.engine[D0].running = 8
        await gw.wait_for(
            "the fleet to see D's streams and capacity",
            lambda: view(gw, D0).busy >= 8 and view(gw, D0).capacity_tokens is not None,
        )
        long = " ".join(f"word{i}" for i in range(600))
        later = await asyncio.gather(*(c.say(long) for c in [sizing, *chats]))
        gw.engine[D0].running = 0
        assert all(a.status == 200 and a.error is None for a in later), [a.body for a in later]
        assert any(a.reason == "shared_gpu" for a in later), [a.reason for a in later]
        assert {a.reason for a in later} <= {"shared_gpu", "itl_headroom"}, [a.reason for a in later]
        after = await asyncio.gather(*(c.say("And then?") for c in [sizing, *chats]))
        assert all(a.status == 200 and a.error is None for a in after), [a.body for a in after]
        d, share = view(gw, D0), gw.svc.settings.decode_memory.pin_budget_share
        assert d.capacity_tokens is not None and gw.engine[D0].pinned_tokens <= d.capacity_tokens * share


async def test_a_retry_after_p_pulled_and_d_refused_finds_the_record() -> None:
    # more in tests/pipeline/test_failed_turns.py
    async with gateway() as gw:
        chat = await conversation(gw)
        gw.engine.faults(D0, refuse=1, leg="decode")
        assert (await chat.say("and then?")).status == 400
        chat.messages.pop()
        a = await chat.say("and then?")
        assert (a.outcome, a.action, a.reason) == ("none", "recompute", "handle_spent")


def test_every_reason_is_covered() -> None:
    """A reason added to ``Reason`` needs a test here (corrupt_record: Redis only, tests/unit/test_store.py)."""
    import inspect
    import sys

    from turnkv.reuse.assess import Reason

    source = inspect.getsource(sys.modules[__name__])
    missing = [r.value for r in Reason if f'"{r.value}"' not in source and r is not Reason.CORRUPT_RECORD]
    assert not missing


async def test_decode_local_turns_prefilling_on_d_are_counted_until_their_first_token() -> None:
    # three conversations' decode-local turns wait on D for their first token: a fourth turn planned meanwhile
    # is told that three prefills share D's steps with it (the ITL check counts their chunks)
    async with gateway(policy={"name": "decode-local"}) as gw:
        chats = [await conversation(gw, stream=True, session=f"c{i}") for i in range(4)]
        gw.engine.faults(D0, busy=3)  # the next three streams' first outputs wait behind D's other work
        waiting = [asyncio.create_task(c.say("go on")) for c in chats[:3]]
        await gw.wait_for("three decode-local prefills on D", lambda: view(gw, D0).local_prefills == 3)
        assert view(gw, D0).local_prefill_tokens > 0
        # D may report the three as waiting when the fleet reads it: with P's queue longer, D's own queue
        # does not send the fourth through P (``decode_queue``, seen once in CI)
        at_p = gw.svc.fleet.hold(P0, work_s=5.0, tokens=200_000)
        a = await chats[3].say("and you?")
        assert a.action == "decode_local" and gw.turns[-1]["load"]["decode_prefills"] == 3
        at_p.release()
        gw.engine.free(D0)
        answers = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        assert [x.action for x in answers] == ["decode_local"] * 3 and all(x.error is None for x in answers)
        await gw.wait_for("no prefill left on D", lambda: view(gw, D0).local_prefills == 0)
        assert view(gw, D0).local_prefill_tokens == 0


async def test_a_turn_whose_history_was_written_back_to_p_says_so() -> None:
    # write_back.mode always: the first turn's handle goes to P's prefix cache and D frees its pin; the next
    # turn finds the whole sequence (prompt and answer) in P's cache and computes only its new part there
    async with gateway(write_back={"mode": "always"}) as gw:
        chat = await conversation(gw)
        first = gw.turns[-1]
        assert first["capture"] == "stored_write_back"
        await gw.wait_for("the write-back", lambda: gw.engine[P0].calls.count("write_back") == 1)
        assert not gw.engine[D0].pins and gw.engine[D0].released == []  # freed by P's read, not a release
        hits = gw.engine[P0].prefix_hits
        a = await chat.say("go on")
        assert (a.outcome, a.action, a.reason) == ("full", "recompute", "written_back")
        assert gw.engine[P0].prefix_hits - hits > first["prompt_tokens"]  # the answer came back to P too


async def test_a_turn_that_comes_before_its_write_back_was_sent_takes_the_handle_back() -> None:
    # P takes one write-back at a time and the first conversation's waits at P: the second's is not sent when
    # its next turn comes. That turn takes the handle back (still pinned on D) and pulls it; the write-back is
    # dropped, and the handle is read once
    async with gateway(write_back={"mode": "always", "max_wait_s": 60}) as gw:
        gw.engine.faults(P0, leg="write_back", busy=1)
        await conversation(gw, session="a")
        await gw.wait_for("a's write-back at P", lambda: gw.engine[P0].calls.count("write_back") == 1)
        b = await conversation(gw, session="b")
        assert gw.turns[-1]["capture"] == "stored_write_back"
        await gw.wait_for("b's write-back waiting for P", lambda: gw.svc.write_backs.waiting == 1)
        answer = await b.say("go on")
        assert (answer.outcome, answer.action, answer.reason) == ("full", "pull", "full_match")
        assert gw.svc.metrics.write_backs.labels("reclaimed")._value.get() == 1
        gw.engine.free(P0)
        await gw.wait_for("no write-back waiting", lambda: gw.svc.write_backs.waiting == 0)
        assert await gw.svc.write_backs.drain(10)
        # a's, then b's second turn's: the one taken back was never sent
        assert gw.engine[P0].calls.count("write_back") == 2
        assert not gw.engine[D0].pins and gw.engine[D0].released == []
