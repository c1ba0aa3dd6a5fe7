"""Pull and recompute turns the record proves go to P before their render returns; the token check, run on
the prompt ids P returns (or, with ``ahead_check: render``, on a render beside P's leg), still gates D
(gateway/turn/ahead.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.integration.cluster import Cluster, Dialogue, metric, sim_state, start_cluster, wait_for
from turnkv import launch
from turnkv.bench.relay import LoopbackRelay

pytestmark = pytest.mark.integration
HOLD_S = 30.0  # the longest the gate holds a render (the test releases it well before)


class RenderGate(LoopbackRelay):
    """The render service as the gateway sees it: P's own render endpoint behind a relay that, once
    closed, holds every render request until the test opens it again."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.held = 0  # render requests held now
        self._closed = threading.Event()
        self._opened: asyncio.Event | None = None

    def close_gate(self) -> None:
        self._closed.set()

    def open_gate(self) -> None:
        self._closed.clear()
        if self._opened is not None:
            self.call_soon(self._opened.set)

    async def to_server(self, data: bytes, conn: dict[str, Any]) -> None:
        if not self._closed.is_set():
            return
        self._opened = self._opened or asyncio.Event()
        self._opened.clear()
        self.held += 1
        try:
            await asyncio.wait_for(self._opened.wait(), HOLD_S)
        finally:
            self.held -= 1


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def _requests(url: str) -> float:
    return metric(url, "vllm:request_success_total")


@contextlib.contextmanager
def _gated_cluster(
    procs: list[launch.Running],
    tmp_path: Path,
    *,
    n_prefill: int = 1,
    prefill_flags: tuple[str, ...] = (),
    sim_flags: tuple[str, ...] = (),
    check: str = "render",
) -> Iterator[tuple[Cluster, RenderGate]]:
    """A cluster (always-pull, a template that keeps history, the check on a render beside P's leg) whose
    render calls pass through a gate, to the colocated truth engine (the same template and tokenizer as P's)."""
    common = ("--time-scale", "0", "--template", "keep", "--vllm-compat", "0.33", *sim_flags)
    ps = [launch.sim(f"prefill{i}", "prefill", *common, *prefill_flags, log_dir=tmp_path) for i in range(n_prefill)]
    d = launch.sim("decode0", "decode", *common, log_dir=tmp_path)
    truth = launch.sim("truth", "colocated", *common, log_dir=tmp_path)
    procs += [*ps, d, truth]
    with RenderGate(_port(truth.url)) as gate:
        env = {
            "TURNKV_HEALTH_INTERVAL_S": "0.2",
            "TURNKV_SCRAPE_INTERVAL_S": "0.2",
            "TURNKV_DECISION_HEADERS": "full",
            "TURNKV_RENDER": f"http://127.0.0.1:{gate.port}",
            "TURNKV_AHEAD_CHECK": check,
        }
        urls = [p.url for p in ps]
        gw = launch.gateway("gateway", urls, [d.url], "--policy", "always-pull", log_dir=tmp_path, env=env)
        procs.append(gw)
        c = Cluster(ps, [d], truth, gw, tmp_path)
        _audited(c)
        yield c, gate


@pytest.fixture
def gated(procs: list[launch.Running], tmp_path: Path) -> Iterator[tuple[Cluster, RenderGate]]:
    # P's prefix cache off, as on another P: a pull is planned ahead only where P likely caches nothing of
    # the conversation (its salted request could not use that cache)
    with _gated_cluster(procs, tmp_path, prefill_flags=("--no-prefix-caching",)) as cg:
        yield cg


def _audited(c: Cluster) -> None:
    wait_for(
        lambda: metric(c.gateway.url, "turnkv_template_class", **{"class": "preserves"}) == 1, what="the template audit"
    )


def test_p_starts_before_a_held_render_returns_and_d_waits_for_the_check(
    gated: tuple[Cluster, RenderGate],
) -> None:
    c, gate = gated
    p, d = c.prefill[0].url, c.decode[0].url
    with Dialogue(c, max_tokens=24) as dialogue, ThreadPoolExecutor(1) as pool:
        first = dialogue.step()
        assert first.correct and first.reason == "no_record"
        p_before, d_before = _requests(p), _requests(d)
        gate.close_gate()
        second = pool.submit(dialogue.step)
        try:
            # P answers its prefill (the pull included) while the render is still held ...
            wait_for(
                lambda: gate.held >= 1 and _requests(p) > p_before,
                what="P's prefill while the render is held",
                state=lambda: (gate.held, _requests(p) - p_before),
            )
            # ... and D has not been sent the turn: the check has not run
            assert _requests(d) == d_before and not second.done()
        finally:
            gate.open_gate()
        t = second.result(timeout=60)
    assert t.correct
    assert t.headers["x-turnkv-ahead"] == "checked"
    assert t.headers["x-turnkv-action"] == "pull" and t.outcome == "full" and t.reason == "full_match"
    # the check ran on the render: the rendered prompt's length and what it proved
    assert int(t.headers["x-turnkv-matched-tokens"]) > 0 and int(t.headers["x-turnkv-prompt-tokens"]) > 0


def test_a_rewritten_history_is_rendered_first_and_checked(gated: tuple[Cluster, RenderGate]) -> None:
    c, gate = gated
    p = c.prefill[0].url
    with Dialogue(c, max_tokens=24) as d:
        d.step()
        d.step()
        # the client compacts the history (as agent frameworks do): the record no longer proves it
        d.messages[1]["content"] = "Plan a short trip, by train."
        p_before = _requests(p)
        gate.close_gate()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(d.step)
            try:
                wait_for(lambda: gate.held >= 1, what="the render of the rewritten turn")
                # rendered first: nothing went to P while its render was held
                assert _requests(p) == p_before and not fut.done()
            finally:
                gate.open_gate()
            edited = fut.result(timeout=60)
        assert edited.correct and "x-turnkv-ahead" not in edited.headers
        assert edited.reason == "history_edited" and edited.outcome in ("partial", "none")
        after = d.step()  # the turn after it is proved by its own record again
    assert after.correct and after.headers["x-turnkv-ahead"] == "checked" and after.outcome == "full"


def test_a_pull_the_check_rejects_falls_back(procs: list[launch.Running], tmp_path: Path) -> None:
    # D's answers retokenize differently when sent back: the history and the echoed answer are as stored,
    # so P pulls ahead, but the render proves less than D's whole sequence: D must not continue from it
    c = start_cluster(
        procs, tmp_path, compat="0.33", sim_flags=("--retokenize-drift",), prefill_flags=("--no-prefix-caching",)
    )
    _audited(c)
    renders = sim_state(c.prefill[0].url)["renders"]
    with Dialogue(c, max_tokens=24) as d:
        turns = [d.step() for _ in range(5)]
    assert all(t.correct for t in turns)
    assert sim_state(c.prefill[0].url)["renders"] == renders  # the check ran on the ids P returned
    later = turns[1:]
    assert all(t.headers.get("x-turnkv-ahead") == "checked" for t in later)
    fell_back = [t for t in later if t.reason == "retokenized"]
    assert fell_back, [t.reason for t in later]
    assert all(t.headers["x-turnkv-action"] == "recompute" and t.outcome == "none" for t in fell_back)
    events = c.turn_events(len(turns))
    assert sum("prefill_render_mismatch" in (e.get("retries") or []) for e in events) == len(fell_back)
    assert metric(c.gateway.url, "turnkv_retries_total", leg="prefill", reason="render_mismatch") == len(fell_back)


@pytest.mark.parametrize("check", ["render", "prefill"])
def test_a_rejected_pull_leaves_nothing_wrong_in_p_cache(
    procs: list[launch.Running], tmp_path: Path, check: str
) -> None:
    # P's prefix cache on. vLLM (and the simulator) cache pulled blocks under the pulling request's own
    # token hashes, whatever they were computed from: a pull the check rejects would serve the fall-back
    # on the same P wrong KV, unless it was salted apart. The conversation's P goes away after turn 1, so
    # turn 2's P caches nothing of it and pulls ahead; answers this long retokenize differently in the
    # simulator, so the check rejects that pull. A render is held until P's pull is done and cached; a
    # check on the ids P returned comes after P's pull anyway (and renders nothing).
    with _gated_cluster(procs, tmp_path, n_prefill=2, sim_flags=("--retokenize-drift",), check=check) as (c, gate):
        with Dialogue(c) as d, ThreadPoolExecutor(1) as pool:
            assert d.step().correct
            home = c.turn_events(1)[-1]["prefill"]
            next(p for p in c.prefill if p.url == home).kill()
            wait_for(
                lambda: not any(p["healthy"] for p in _ready(c)["prefill"] if p["url"] == home),
                what="P to be unhealthy",
            )
            other = next(p.url for p in c.prefill if p.url != home)
            before, renders = _requests(other), sim_state(c.truth.url)["renders"]
            if check == "render":
                gate.close_gate()
            fut = pool.submit(d.step)
            try:
                if check == "render":
                    wait_for(lambda: gate.held >= 1 and _requests(other) > before, what="P's pull, render held")
            finally:
                gate.open_gate()
            t = fut.result(timeout=60)
        assert t.correct
        assert t.headers["x-turnkv-ahead"] == "checked" and t.reason == "retokenized"
        assert t.headers["x-turnkv-action"] == "recompute"
        assert metric(c.gateway.url, "turnkv_retries_total", leg="prefill", reason="render_mismatch") == 1
        assert sim_state(c.truth.url)["renders"] == renders + (1 if check == "render" else 0)


def _ready(c: Cluster) -> dict[str, Any]:
    with urllib.request.urlopen(c.gateway.url + "/ready", timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def test_many_conversations_at_once_pull_ahead_and_stay_correct(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33", prefill_flags=("--no-prefix-caching",))
    _audited(c)
    engines = [c.prefill[0].url, c.decode[0].url]
    renders = [sim_state(u)["renders"] for u in engines]

    def talk(i: int) -> list[Any]:
        with Dialogue(c, session=f"conv-{i}", max_tokens=24, stream=i % 2 == 1) as d:
            return [d.step() for _ in range(4)]

    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(talk, range(8)))
    turns = [t for run in runs for t in run]
    assert all(t.correct for t in turns)
    later = [t for run in runs for t in run[1:]]
    assert all(t.headers.get("x-turnkv-ahead") == "checked" and t.outcome == "full" for t in later)
    assert all(int(t.headers["x-turnkv-matched-tokens"]) > 0 for t in later)
    # checked on the ids P returned with its answer: no render call went to any engine
    assert [sim_state(u)["renders"] for u in engines] == renders


@pytest.mark.parametrize(("policy", "ahead", "action"), [("never-pull", "skipped", "recompute")])
def test_a_recompute_the_record_proves_is_not_rendered(
    procs: list[launch.Running], tmp_path: Path, policy: str, ahead: str, action: str
) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33", policy=policy)
    _audited(c)
    renders = sim_state(c.prefill[0].url)["renders"]
    with Dialogue(c, max_tokens=24) as d:
        turns = [d.step() for _ in range(3)]
    assert all(t.correct for t in turns)
    for t in turns[1:]:
        assert t.headers["x-turnkv-ahead"] == ahead and t.headers["x-turnkv-action"] == action
        assert t.reason == "cheaper_to_recompute"
    assert sim_state(c.prefill[0].url)["renders"] == renders  # nothing rendered in the gateway's turns


def test_vllm_multiturn_baseline_pulls_without_a_render(procs: list[launch.Running], tmp_path: Path) -> None:
    # P's prefix cache off: with it on, the proxy's policy pulls nothing P already holds
    c = start_cluster(procs, tmp_path, compat="0.33", policy="vllm-multiturn", prefill_flags=("--no-prefix-caching",))
    _audited(c)
    renders = sim_state(c.prefill[0].url)["renders"]
    with Dialogue(c, max_tokens=24) as d:
        turns = [d.step() for _ in range(3)]
    assert all(t.correct for t in turns)  # the keep template: the unchecked pull happens to be right
    assert all(t.headers["x-turnkv-ahead"] == "skipped" and t.headers["x-turnkv-action"] == "pull" for t in turns[1:])
    assert sim_state(c.prefill[0].url)["renders"] == renders
