"""Several gateways behind one balancer, sharing Redis: a conversation that alternates between them keeps
its reuse, both count the same pins, and a drain on one moves new turns to the other without losing a
turn (its own turn in flight ends with [DONE], its record written for the next turn, wherever that lands).

Real processes on loopback: two gateways, a prefill and a decode engine (simulated), redis-server, and a
TCP balancer that checks each gateway's /ready (tests/integration/balancer.py). The clients open a new
connection per request, so the balancer's round robin alternates the turns.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.balancer import Balancer
from tests.integration.cluster import Cluster, Dialogue, metric, sim_control, sim_state, wait_for
from turnkv import launch

pytestmark = pytest.mark.integration

REUSE = {"full", "decode_local"}
TURNS = 6


def client(url: str) -> openai.OpenAI:
    """A client whose requests close their connection: the balancer places each turn afresh."""
    return openai.OpenAI(
        base_url=url + "/v1", api_key="k", max_retries=0, timeout=60, default_headers={"connection": "close"}
    )


def test_two_gateways_share_conversations_pins_and_a_drain(
    procs: list[launch.Running], tmp_path: Path, redis_url: str
) -> None:
    common = ("--time-scale", "0", "--template", "keep", "--vllm-compat", "0.33")
    p = launch.sim("prefill0", "prefill", *common, log_dir=tmp_path)
    d = launch.sim("decode0", "decode", *common, log_dir=tmp_path)
    truth = launch.sim("truth", "colocated", *common, log_dir=tmp_path)
    procs += [p, d, truth]
    env = {
        "TURNKV_HEALTH_INTERVAL_S": "0.2",
        "TURNKV_SCRAPE_INTERVAL_S": "0.2",
        "TURNKV_DECISION_HEADERS": "full",
        "TURNKV_SHUTDOWN_DELAY_S": "1",  # /ready fails at once; still listening while the balancer notices
    }
    args = ("--policy", "always-pull", "--redis-url", redis_url)
    gws = [launch.gateway(f"gateway-{x}", [p.url], [d.url], *args, log_dir=tmp_path, env=env) for x in ("a", "b")]
    procs += gws
    a, b = gws
    cluster = Cluster([p], [d], truth, a, tmp_path)
    with Balancer([a.url, b.url]) as lb:
        wait_for(lambda: all(lb.ready.values()), what="both gateways ready")

        # one conversation, its turns alternating between the gateways: reuse on every turn after the first
        with Dialogue(cluster, session="alternating") as conv:
            via = client(lb.url)
            turns = [conv.step(client=via) for _ in range(TURNS)]
        assert all(t.correct for t in turns)
        assert [t.outcome for t in turns[1:]] == ["full"] * (TURNS - 1), [t.reason for t in turns]
        assert lb.served[:TURNS] == [a.url, b.url] * (TURNS // 2)

        # the pins are the store's: each gateway counts every conversation's, and they are D's
        with Dialogue(cluster, session="second") as other:
            other.step(client=via, truth=False)

        def counted() -> list[float]:
            return [metric(g.url, "turnkv_pinned_handles", decode=d.url) for g in gws]

        wait_for(lambda: counted() == [2, 2] and sim_state(d.url)["pins"] == 2, what="2 pins", state=counted)

        # a drain on the gateway that takes the next turn: that turn is held at D while the drain begins
        held = Dialogue(cluster, session="held", stream=True)
        held.step(client=via, truth=False)  # its first turn; its second goes to the next gateway in turn
        draining = next(g for g in gws if g.url == lb.backends[lb._next])
        staying = b if draining is a else a
        sim_control(d.url, delay_ms=60_000)
        ended: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: ended.update(turn=held.step(client=via, truth=False)))
        thread.start()
        wait_for(lambda: metric(draining.url, "turnkv_inflight_turns") == 1, what="the held turn in flight")
        draining.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not lb.ready[draining.url], what="the balancer to see the drain")
        # new turns meanwhile: all go to the other gateway, none is lost
        with Dialogue(cluster, session="during-drain") as during:
            sim_control(d.url, delay_ms=0)  # D answers again: the held turn and these
            moved = [during.step(client=via) for _ in range(3)]
        thread.join(60)
        assert all(t.correct for t in moved) and [t.outcome for t in moved[1:]] == ["full", "full"]
        assert lb.served[-3:] == [staying.url] * 3
        assert ended["turn"].headers["x-turnkv-outcome"] == "full"  # finished on the draining gateway
        assert draining.proc.wait(60) is not None  # it exited once its turn was done

        # the held conversation goes on, on the other gateway, from the record the drained one wrote
        after = held.step(client=via)
        assert after.correct and after.outcome == "full"
        assert lb.served[-1] == staying.url
