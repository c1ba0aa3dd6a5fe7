"""The adaptive policy's choice follows the measured link, and unused handles give decode memory back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cluster import REAL_TIME, Dialogue, metric, sim_state, start_cluster, wait_for
from turnkv import launch
from turnkv.bench.redis_server import RedisServer

pytestmark = pytest.mark.integration
LONG_SYSTEM = "You are a careful agent. Follow the house rules about travel, budgets and safety. " * 60


@pytest.mark.parametrize(("link", "action"), [("host", "recompute"), ("nvlink", "pull")])
def test_adaptive_path_follows_the_link(procs: list[launch.Running], tmp_path: Path, link: str, action: str) -> None:
    # real simulated timing; P's cache off, as on another prefill instance; decode-local off: pull or recompute
    c = start_cluster(
        procs,
        tmp_path,
        policy="adaptive",
        sim_flags=("--time-scale", "1", "--link", link),
        prefill_flags=("--no-prefix-caching",),
        gateway_env={"TURNKV_POLICY__PARAMS": '{"decode_local": false}'},
    )
    with Dialogue(c, system=LONG_SYSTEM, max_tokens=24) as d:
        first = d.step()
        assert first.correct and int(first.headers["x-turnkv-prompt-tokens"]) > 4000
        # turn 1's P->D transfer is the gateway's first measurement of the link
        wait_for(lambda: metric(c.gateway.url, "turnkv_link_samples", direction="push") >= 1, what="a link measurement")
        second = d.step()
    assert second.correct and second.outcome in ("full", "none")
    assert second.headers["x-turnkv-action"] == action
    if action == "recompute":
        assert second.reason == "cheaper_to_recompute"


@REAL_TIME
def test_a_link_fast_only_towards_decode_is_learnt_from_the_first_pull(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # A simulated engine charges the transfers it reads at its own link: D reads P's blocks over
    # nvlink, P pulls D's over the host link (as with CUDA IPC on one H200: fast one way, slow back).
    c = start_cluster(
        procs,
        tmp_path,
        policy="adaptive",
        sim_flags=("--time-scale", "1"),
        prefill_flags=("--no-prefix-caching", "--link", "host"),
        decode_flags=("--link", "nvlink"),
        gateway_env={"TURNKV_POLICY__PARAMS": '{"decode_local": false}'},
    )
    with Dialogue(c, system=LONG_SYSTEM, max_tokens=24) as d:
        d.step()
        wait_for(
            lambda: metric(c.gateway.url, "turnkv_link_samples", direction="push") >= 1, what="a P -> D measurement"
        )
        # nothing measured D -> P yet: the fast P -> D estimate stands in, so P pulls
        second = d.step()
        assert second.correct and second.headers["x-turnkv-action"] == "pull"
        wait_for(
            lambda: metric(c.gateway.url, "turnkv_link_samples", direction="pull") >= 1, what="a D -> P measurement"
        )
        third = d.step()
    assert third.correct and third.headers["x-turnkv-action"] == "recompute"
    assert third.reason == "cheaper_to_recompute"
    pull_bw = metric(c.gateway.url, "turnkv_link_bytes_per_second", direction="pull")
    push_bw = metric(c.gateway.url, "turnkv_link_bytes_per_second", direction="push")
    pull_fixed = metric(c.gateway.url, "turnkv_link_fixed_seconds", direction="pull")
    push_fixed = metric(c.gateway.url, "turnkv_link_fixed_seconds", direction="push")
    # the two directions were learnt apart (simulated 0.43 vs 300 GB/s): in the bandwidth, or, where the
    # pulls measured are all of one size, in the fixed cost their own times imply at the fitted push line's
    assert 10 * pull_bw < push_bw or pull_fixed > 10 * push_fixed, (pull_bw, push_bw, pull_fixed, push_fixed)


def test_decode_local_when_the_delta_is_small(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, policy="adaptive", sim_flags=("--time-scale", "1"))

    def renders() -> int:
        return int(sim_state(c.prefill[0].url)["renders"])

    # the start-up template audit renders on P too, in the background if P came up after the gateway
    wait_for(
        lambda: metric(c.gateway.url, "turnkv_template_class", **{"class": "preserves"}) == 1, what="the template audit"
    )
    with Dialogue(c, system=LONG_SYSTEM, max_tokens=24) as d:
        before = renders()
        first = d.step()
        # a first turn with nothing stored is not rendered by the gateway: P and D render it themselves
        assert first.correct and first.reason == "no_record" and renders() == before
        assert int(first.headers["x-turnkv-prompt-tokens"]) > 4000  # P's count
        t = d.step()
        assert t.correct and t.outcome == "decode_local" and t.reason == "decode_local"
        # the template keeps history and the answer came back as sent: no render call before D
        assert t.headers.get("x-turnkv-direct") == "true" and "x-turnkv-prompt-tokens" not in t.headers
        assert renders() == before
        assert d.step().correct  # the decode-local turn left a handle for the next one
        # an edited answer: D's cache no longer covers it as expected, so the turn is rendered and checked
        d.messages[-2]["content"] += " (edited by the client)"
        edited = d.step()
        assert edited.correct and "x-turnkv-direct" not in edited.headers
        assert edited.headers["x-turnkv-matched-tokens"] != "0" and edited.outcome == "decode_local"
        assert d.step().headers.get("x-turnkv-direct") == "true"
        # a compacted history with the last answer intact (as agent frameworks do): rendered and checked
        del d.messages[1:3]
        compacted = d.step()
        assert compacted.correct and "x-turnkv-direct" not in compacted.headers


def test_no_direct_decode_local_when_the_template_drops_reasoning(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, template="strip", policy="adaptive", sim_flags=("--time-scale", "1"))
    with Dialogue(c, system=LONG_SYSTEM, max_tokens=24) as d:
        d.step()
        t = d.step()
    assert t.correct and "x-turnkv-direct" not in t.headers and t.reason != "full_match"


def test_a_handle_that_cannot_be_stored_is_released(
    procs: list[launch.Running], tmp_path: Path, own_redis: RedisServer
) -> None:
    c = start_cluster(procs, tmp_path, redis_url=own_redis.url)
    own_redis.stop()
    with Dialogue(c) as d:
        assert d.step().reason == "store_unavailable"
    # D pinned its blocks for the next turn, but nobody can find that handle: it is given back
    wait_for(lambda: sim_state(c.decode[0].url)["pinned_tokens"] == 0, what="D to free the handle")
    assert metric(c.gateway.url, "turnkv_handle_releases_total", why="store_unavailable") == 1


@pytest.mark.parametrize(("compat", "stream"), [("0.26", False), ("0.33", True)])
def test_stateless_turns_do_not_leave_decode_memory_pinned(
    procs: list[launch.Running], tmp_path: Path, compat: str, stream: bool
) -> None:
    # a bidirectional D pins its blocks after every P/D answer; without a conversation nobody will pull them
    # (none is found from the messages either: that is turned off here)
    # (told to release them at once: by default they are left to D's TTL within decode_memory.unused_share,
    # tests/pipeline/test_capture.py)
    env = {"TURNKV_CONVERSATION_FROM_HISTORY": "false", "TURNKV_DECODE_MEMORY__UNUSED_SHARE": "0"}
    c = start_cluster(procs, tmp_path, compat=compat, gateway_env=env)
    with Dialogue(c, session=None, stream=stream) as d:
        assert d.step().outcome == "stateless"
    wait_for(lambda: sim_state(c.decode[0].url)["pinned_tokens"] == 0, what="D to free the unused handle")
    assert metric(c.gateway.url, "turnkv_handle_releases_total", why="unused") == 1
