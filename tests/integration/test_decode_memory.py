"""Decode memory under load: pins within a budget, nothing left pinned by accident, no turn hangs.

The simulated decode engine counts pinned blocks against its capacity and makes requests wait for
free blocks, as vLLM does; its /_sim/state says what it pins (and how much of it no release can free).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.cluster import (
    REAL_TIME,
    Cluster,
    Dialogue,
    Turn,
    metric,
    sim_control,
    sim_state,
    start_cluster,
    wait_for,
)
from turnkv import launch

pytestmark = pytest.mark.integration

BLOCK = 16
DECODE_BLOCKS = 400  # 6,400 tokens of KV: less than the pins of the conversations below would take
BUDGET_SHARE = 0.5
UNUSED_SHARE = 0.1  # handles nobody will pull (the policy does not keep them), left to D's TTL up to this share
FAST_JANITOR = {
    "TURNKV_DECODE_MEMORY__JANITOR_INTERVAL_S": "0.2",
    "TURNKV_DECODE_MEMORY__PIN_BUDGET_SHARE": str(BUDGET_SHARE),
    "TURNKV_DECODE_MEMORY__UNUSED_SHARE": str(UNUSED_SHARE),
}


class PinSampler:
    """Reads the decode engine's pinned tokens while conversations run (bounded: it stops with them)."""

    def __init__(self, url: str) -> None:
        self.url, self.samples = url, [0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.samples.append(int(sim_state(self.url)["pinned_tokens"]))

    def __enter__(self) -> PinSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _conversation(c: Cluster, i: int, turns: int, stream: bool) -> list[Turn]:
    with Dialogue(c, session=f"conv-{i}", stream=stream, system=f"You are agent number {i}.", max_tokens=60) as d:
        return [d.step() for _ in range(turns)]


def _run_many(c: Cluster, n: int, turns: int, at_once: int | None = None) -> list[list[Turn]]:
    with ThreadPoolExecutor(at_once or n) as pool:
        return list(pool.map(lambda i: _conversation(c, i, turns, stream=i % 2 == 0), range(n)))


def test_many_conversations_on_a_decode_engine_too_small_to_pin_them_all(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # 16 conversations pinning ~20 blocks each at their last turn would take 320 of D's 400 blocks; the
    # budget is 200. Without it the pins alone would leave running turns waiting for blocks. Write-back off:
    # every handle the policy keeps stays pinned, as the budget is to bound (with it, the next test)
    c = start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        decode_flags=("--num-gpu-blocks", str(DECODE_BLOCKS)),
        gateway_env={**FAST_JANITOR, "TURNKV_WRITE_BACK__MODE": "off"},
    )
    # stored pins within their budget, and the handles nobody will pull within their own share
    budget = int(DECODE_BLOCKS * BLOCK * BUDGET_SHARE) + int(DECODE_BLOCKS * BLOCK * UNUSED_SHARE)
    with PinSampler(c.decode[0].url) as pins:
        results = _run_many(c, 16, 5)
    later = [t for conv in results for t in conv[1:]]
    assert all(t.correct for conv in results for t in conv)  # every answer equals the colocated truth
    # the budget holds about 10 of the 16 conversations' handles; releasing the idle-longest first is, for
    # conversations in lockstep with no think time, near the worst order (the one idle longest comes back
    # next), so how many stay is this machine's timing: 23-30 of 64 with the cores saturated, half or more idle
    assert sum(t.outcome == "full" for t in later) >= len(later) // 4, [t.reason for t in later]
    assert any(t.reason == "pin_released" for t in later)  # the budget bit: some handles were given back
    assert metric(c.gateway.url, "turnkv_handle_releases_total", why="budget") > 0
    # At rest the pins are within budget; while turns run, D's new handles exist before the gateway can
    # release older ones, so the peak may pass it by at most the handles of the turns in flight.
    wait_for(
        lambda: sim_state(c.decode[0].url)["pinned_tokens"] <= budget,
        timeout_s=30,
        what=f"pins within budget at rest ({budget} tokens)",
        state=lambda: (
            sim_state(c.decode[0].url),
            metric(c.gateway.url, "turnkv_pinned_kv_tokens"),
            metric(c.gateway.url, "turnkv_handle_releases_total", why="failed"),
        ),
    )
    assert max(pins.samples) <= budget + 16 * 25 * BLOCK
    assert sim_state(c.decode[0].url)["untracked_pins"] == 0
    assert metric(c.gateway.url, "turnkv_pinned_kv_budget_bytes") > 0


@REAL_TIME
def test_the_same_conversations_with_write_back_leave_d_nothing_pinned_at_rest(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # at the gateway's defaults a pressed D keeps no pins: each turn's handle goes to P's prefix cache, so the
    # later turns find their history there (or pull it, where a write-back was not sent), and once the last
    # write-backs are done D pins nothing
    # engines that take some time (a decode step ~1.6 ms): a write-back's abort reaches P within its tokens
    c = start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        sim_flags=("--time-scale", "0.2"),
        decode_flags=("--num-gpu-blocks", str(DECODE_BLOCKS)),
        gateway_env=FAST_JANITOR,
    )
    results = _run_many(c, 16, 5)
    later = [t for conv in results for t in conv[1:]]
    assert all(t.correct for conv in results for t in conv)  # every answer equals the colocated truth
    assert sum(t.reason == "written_back" for t in later) >= len(later) // 4, [t.reason for t in later]
    assert metric(c.gateway.url, "turnkv_write_backs_total", result="cached") > 0
    wait_for(
        lambda: sim_state(c.decode[0].url)["pinned_tokens"] == 0,
        timeout_s=30,
        what="nothing pinned on D at rest",
        state=lambda: sim_state(c.decode[0].url),
    )
    assert sim_state(c.prefill[0].url)["pins"] == 0  # nor on P: every write-back was aborted after its pull


SMALL_BLOCKS = 160  # 2,560 tokens of KV; turns may reserve 0.9 of it: 2,304


def _realtime_cluster(procs: list[launch.Running], tmp_path: Path, policy: str = "always-pull", **env: str) -> Cluster:
    """D decodes in real time (8 ms a token), so a long answer holds its KV for seconds, and its KV is
    small: a few long answers fill it. Decode admission is on (it is off by default)."""
    env = {"TURNKV_DECODE_MEMORY__ADMIT_SHARE": "0.9", **env}
    return start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        policy=policy,
        decode_flags=("--time-scale", "1", "--num-gpu-blocks", str(SMALL_BLOCKS)),
        gateway_env=env,
    )


def _holder(c: Cluster) -> tuple[httpx.Client, Any, Any]:
    """A turn in flight on D that reserves prompt + 2,000 answer tokens: what is left cannot hold another
    turn asking for 400."""
    messages = [{"role": "user", "content": "Write a long story."}]
    body = {"model": "sim-model", "messages": messages, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    http = httpx.Client(timeout=60)
    req = http.build_request(
        "POST", c.gateway.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}
    )
    resp = http.send(req, stream=True)
    lines = resp.iter_lines()  # kept: a dropped line iterator closes the response
    assert next(lines).startswith("data: ")  # admitted and running on D
    return http, resp, lines


def test_a_turn_that_does_not_fit_waits_for_room_on_the_decode_engine(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    c = _realtime_cluster(procs, tmp_path)
    http, resp, _lines = _holder(c)
    with ThreadPoolExecutor(1) as pool, Dialogue(c, session="b", stream=True, max_tokens=400) as d:
        waiting = pool.submit(d.step)
        wait_for(
            lambda: metric(c.gateway.url, "turnkv_decode_admission_waits_total") == 1,
            what="the second turn waiting in the gateway",
            state=lambda: (
                waiting.done() and waiting.result().headers,
                metric(c.gateway.url, "turnkv_pinned_kv_capacity_bytes"),
                sim_state(c.decode[0].url),
            ),
        )
        assert not waiting.done()
        resp.close()  # the first turn ends (its client left): its room is given back
        http.close()
        turn = waiting.result(timeout=60)
    assert turn.correct
    assert metric(c.gateway.url, "turnkv_decode_admission_waits_total") == 1


def test_a_turn_p_prefilled_goes_to_d_after_its_overflow_wait(procs: list[launch.Running], tmp_path: Path) -> None:
    # P holds the turn's KV for D only for its lease: past admission_overflow_s the turn goes to D
    # all the same (D's own queue keeps P's lease), rather than waste P's work on a 503
    c = _realtime_cluster(procs, tmp_path, TURNKV_DECODE_MEMORY__ADMISSION_OVERFLOW_S="0.5")
    http, resp, _lines = _holder(c)
    with Dialogue(c, session="b", max_tokens=400) as d:
        turn = d.step()  # answered while the holder still runs
    assert turn.correct
    assert metric(c.gateway.url, "turnkv_decode_admission_overflows_total") == 1
    resp.close()
    http.close()


def test_a_decode_local_turn_that_waits_past_the_admission_deadline_gets_a_503(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # decode-local by policy, and only once the gateway sees nothing waiting on D: adaptive's choice (and
    # the room rule's, from D's and P's queues as last read) once sent this turn through P under CI's load
    c = _realtime_cluster(procs, tmp_path, policy="decode-local", TURNKV_DECODE_MEMORY__ADMISSION_WAIT_S="0.5")
    with Dialogue(c, session="c", stream=True, max_tokens=400) as conv:
        assert conv.step().correct
        http, resp, _lines = _holder(c)  # no turn waits: the next turn goes decode-local, and does not fit
        wait_for(lambda: _gateway_sees(c, lambda e: e["waiting"] == 0), what="the gateway seeing nothing wait on D")
        with pytest.raises(openai.APIStatusError) as err:
            conv.step()
        resp.close()
        http.close()
    assert err.value.status_code == 503 and int(err.value.response.headers["retry-after"]) >= 1
    assert "decode engines are full" in err.value.message
    with Dialogue(c, session="d", max_tokens=400) as d:  # the holder's room came back
        assert d.step().correct


def test_no_decode_local_turn_while_turns_wait_for_room_on_the_decode_engine(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # turns waiting in the gateway for room on D are D's queue all the same: a decode-local turn there
    # would wait behind them and then prefill on D; it goes through P instead, and says why
    c = _realtime_cluster(procs, tmp_path, policy="adaptive")
    with Dialogue(c, session="c", stream=True) as conv:
        assert conv.step().correct
        http, resp, _lines = _holder(c)
        with ThreadPoolExecutor(2) as pool, Dialogue(c, session="b", stream=True, max_tokens=400) as waiter:
            waiting = pool.submit(waiter.step)
            wait_for(
                lambda: metric(c.gateway.url, "turnkv_decode_admission_waits_total") == 1,
                what="a turn waiting in the gateway",
            )
            second = pool.submit(conv.step)
            wait_for(
                lambda: metric(c.gateway.url, "turnkv_decode_admission_waits_total") == 2,
                what="the conversation's second turn waiting too",
            )
            resp.close()
            http.close()
            assert waiting.result(timeout=60).correct
            turn = second.result(timeout=60)
    assert turn.correct and turn.reason == "decode_busy" and turn.headers["x-turnkv-action"] != "decode_local"
    event = c.turn_events(4)[-1]
    assert event["admission_ms"] > 0


def test_decode_local_turns_leave_nothing_pinned(procs: list[launch.Running], tmp_path: Path) -> None:
    # vLLM pins a request whose params name neither direction without tracking it: no release and no TTL
    # ever frees it. Decode-local turns must not create such pins, and a handle a later turn does not use is
    # released (at once here: by default it is left to D's TTL, within decode_memory.unused_share).
    c = start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        policy="adaptive",
        decode_flags=("--num-gpu-blocks", str(DECODE_BLOCKS)),
        gateway_env={
            **FAST_JANITOR,
            "TURNKV_DECODE_MEMORY__UNUSED_SHARE": "0",
            # the ITL checks off: they have their own tests, and whether the other conversation streams on D
            # when a turn is planned is this machine's timing (a CI run once had 8 of 18 refused itl_headroom)
            "TURNKV_POLICY__PARAMS": json.dumps({"itl_headroom": None, "itl_budget_ms": None}),
        },
    )
    # two at a time: with all six at once on a loaded machine, most later turns were once refused
    # decode-local as decode_busy (D or the gateway had turns waiting for it when they were planned)
    results = _run_many(c, 6, 4, at_once=2)
    later = [t for conv in results for t in conv[1:]]
    assert all(t.correct for conv in results for t in conv)
    assert sum(t.outcome == "decode_local" for t in later) >= 12, [t.reason for t in later]
    d = c.decode[0].url
    state = sim_state(d)
    assert state["untracked_pins"] == 0 and state["unrecognized_notices"] == 0
    # At rest D pins exactly the handles the gateway still keeps for a next turn: none after a decode-local
    # last turn, at most one where the last turn went through P (on a loaded machine some do, decode_busy,
    # and the policy may keep that handle as a hedge). A pin the gateway forgot would stay on D uncounted.
    wait_for(
        lambda: sim_state(d)["pins"] == metric(c.gateway.url, "turnkv_pinned_handles"),
        what="D's pins to be the gateway's kept handles",
        state=lambda: (sim_state(d)["pins"], metric(c.gateway.url, "turnkv_pinned_handles")),
    )
    last = [(conv[-1].headers["x-turnkv-action"], conv[-1].reason) for conv in results]
    assert sim_state(d)["pins"] <= sum(action != "decode_local" for action, _ in last), last


def _long_stream(c: Cluster, session: str, messages: list[dict[str, Any]]) -> tuple[httpx.Client, Any]:
    body = {"model": "sim-model", "messages": messages, "max_tokens": 20000, "ignore_eos": True, "stream": True}
    http = httpx.Client(timeout=30)
    resp = http.send(
        http.build_request(
            "POST",
            c.gateway.url + "/v1/chat/completions",
            json=body,
            headers={"X-Session-ID": session, "Authorization": "Bearer key-a"},
        ),
        stream=True,
    )
    return http, resp


def test_sigterm_with_turns_in_flight_leaves_no_pins(procs: list[launch.Running], tmp_path: Path) -> None:
    # D decodes in real time (8 ms a token): the long answer is still being generated at the shutdown
    c = start_cluster(
        procs, tmp_path, compat="0.33", gateway_env={"TURNKV_DRAIN_S": "0.5"}, decode_flags=("--time-scale", "1")
    )
    with Dialogue(c, session="a") as d, Dialogue(c, session="b") as other:
        d.step()
        other.step()  # its handle stays stored, pinned on D
        http, resp = _long_stream(c, "a", d.messages)
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # in flight
        assert sim_state(c.decode[0].url)["pins"] == 1
        c.gateway.stop()
        rest = [x for x in lines if x]
        http.close()
    # the turn still running when the drain ran out ended with an error event, not a cut connection
    assert any('"shutting_down"' in x for x in rest) and rest[-1] == "data: [DONE]"
    # with the in-process store nobody else can use the stored handles: all were given back
    assert sim_state(c.decode[0].url)["pins"] == 0


def test_a_client_that_leaves_mid_stream_leaves_no_pins(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33")
    with Dialogue(c, session="a") as d:
        d.step()
        http, resp = _long_stream(c, "a", d.messages)
        assert next(resp.iter_lines()).startswith("data: ")
        resp.close()
        http.close()
    c.turn_events(2)  # the abandoned turn is settled and logged
    wait_for(lambda: sim_state(c.decode[0].url)["pins"] == 0, what="no pins left on D")


def test_a_decode_engine_that_misses_the_first_token_deadline(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        n_decode=2,
        gateway_env={"TURNKV_TIMEOUTS__DECODE_FIRST_TOKEN_S": "1", "TURNKV_TIMEOUTS__DECODE_PER_TOKEN_S": "0.1"},
    )
    with Dialogue(c, session="a", stream=True) as d:
        first = d.step()
        holder = c.turn_events(1)[0]["decode"]
        sim_control(holder, delay_ms=60_000)  # the D holding the conversation accepts turns, never starts them
        second = d.step()
    assert first.correct and second.correct  # run again through P, on the other D
    event = c.turn_events(2)[1]
    assert event["decode"] != holder and "decode_first_token_deadline" in event["retries"]
    assert metric(c.gateway.url, "turnkv_first_token_deadline_misses_total", leg="decode") >= 1
    for e in c.decode:
        sim_control(e.url, delay_ms=60_000)
    with c.client() as client, pytest.raises(openai.APIError) as err:
        client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert "deadline" in str(err.value)  # an answer within seconds, not minutes of silence
    for e in c.decode:
        sim_control(e.url, delay_ms=0)


def _hog(c: Cluster, n: int, tokens: int) -> list[tuple[httpx.Client, Any]]:
    """Long answers sent to D directly, holding its KV while they run."""
    hogs = []
    for i in range(n):
        http = httpx.Client(timeout=60)
        body = {"model": "sim-model", "prompt": f"hog {i}", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        hogs.append(
            (http, http.send(http.build_request("POST", c.decode[0].url + "/v1/completions", json=body), stream=True))
        )
    wait_for(
        lambda: sim_state(c.decode[0].url)["free_blocks"] < 8, timeout_s=30, what="D's KV held by the long answers"
    )
    return hogs


def _unhog(hogs: list[tuple[httpx.Client, Any]]) -> None:
    for http, resp in hogs:
        resp.close()
        http.close()


def _gateway_sees(c: Cluster, pred: Any) -> bool:
    with httpx.Client(timeout=10) as http:
        d = http.get(c.gateway.url + "/ready").json()["decode"][0]
    return bool(pred(d))


@REAL_TIME
def test_no_decode_local_turn_on_a_decode_engine_short_of_kv(procs: list[launch.Running], tmp_path: Path) -> None:
    # a D out of blocks has evicted idle conversations' freed blocks: decode-local there would compute
    # the whole history again, behind a queue. The turn goes through P, and says why.
    c = _realtime_cluster(procs, tmp_path, policy="adaptive")
    with Dialogue(c, session="a", stream=True) as d:
        assert d.step().correct
        hogs = _hog(c, 3, 1000)
        wait_for(lambda: _gateway_sees(c, lambda e: e["kv_cache_usage"] >= 0.9), what="the gateway seeing D full")
        turn = d.step()
        _unhog(hogs)
    assert turn.correct and turn.reason == "decode_busy" and turn.headers["x-turnkv-action"] == "recompute"


def test_no_decode_local_turn_on_a_decode_engine_queued_longer_than_the_idle_prefill_engine(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # D's KV pressure out of the way (1.01) and no decode admission, so only D's queue counts:
    # long answers fill D and one of them waits for blocks, while P is idle. D's queue is the longer one:
    # the turn goes through P (and waits for D's blocks there all the same), and says decode_queue.
    c = _realtime_cluster(
        procs,
        tmp_path,
        policy="decode-local",
        TURNKV_DECODE_MEMORY__ADMIT_SHARE="0",
        TURNKV_DECODE_MEMORY__PRESSURE_KV_USAGE="1.01",
    )
    with Dialogue(c, session="a", stream=True) as d:
        assert d.step().correct
        hogs = _hog(c, 3, 1000)
        wait_for(lambda: _gateway_sees(c, lambda e: e["waiting"] >= 1), what="the gateway seeing requests wait on D")
        turn = d.step()  # served once a long answer ends and frees its blocks
        _unhog(hogs)
    assert turn.correct and turn.reason == "decode_queue" and turn.headers["x-turnkv-action"] == "recompute"
    assert c.turn_events(2)[-1]["load"]["decode_room"]["state"] == "queue_longer"


def test_a_busy_decode_engine_is_waited_for_past_the_first_token_deadline(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # D decodes in real time and three long answers sent to it directly hold its KV: a turn waits there
    # for blocks far longer than the 1 s deadline, while D's counters show it working. Giving up on a
    # busy engine would only add a retry to its queue: the turn is waited for, and answered.
    c = _realtime_cluster(procs, tmp_path, TURNKV_TIMEOUTS__DECODE_FIRST_TOKEN_S="1")
    hogs = _hog(c, 3, 1000)
    with Dialogue(c, session="a", stream=True) as d:
        turn = d.step()
    assert turn.correct
    assert metric(c.gateway.url, "turnkv_first_token_deadline_misses_total") == 0
    assert metric(c.decode[0].url, "vllm:num_preemptions_total") > 0  # D was out of blocks meanwhile
    _unhog(hogs)


def test_a_client_that_leaves_before_the_first_token_is_settled_cleanly(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # the turn waits for its first token behind a full D; the client gives up. Nothing else may read D's
    # stream while that wait is still reading it (a crash seen on the H200: readany() while another
    # coroutine waits), and the turn is settled and logged.
    c = _realtime_cluster(procs, tmp_path)
    with Dialogue(c, session="a") as d:
        d.step()
        hogs = _hog(c, 3, 1000)
        http, resp = _long_stream(c, "a", d.messages)
        assert resp.status_code == 200  # D's stream is open; its first token is not there yet
        resp.close()
        http.close()
    c.turn_events(2)
    _unhog(hogs)
    log = (tmp_path / "gateway.log").read_text()
    assert "Exception in ASGI application" not in log and "readany" not in log
