"""The Kubernetes stop sequence on a real gateway process (deploy/kubernetes/gateway/deployment.yaml): the
preStop sends SIGTERM itself (``/ready`` fails at once, the gateway still serves for ``shutdown_delay_s``),
then the kubelet's own SIGTERM follows; the turn in flight through both still ends with ``[DONE]``."""

from __future__ import annotations

import signal
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import Dialogue, metric, sim_control, start_cluster, wait_for
from turnkv import launch

pytestmark = pytest.mark.integration


def ready(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def listening(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0


def test_a_prestop_sigterm_then_the_kubelets_finishes_the_turn_in_flight(
    procs: list[launch.Running], tmp_path: Path, redis_url: str
) -> None:
    c = start_cluster(
        procs, tmp_path, redis_url=redis_url, compat="0.33", gateway_env={"TURNKV_SHUTDOWN_DELAY_S": "10"}
    )
    gw, d = c.gateway, c.decode[0].url
    with Dialogue(c, session="held", stream=True) as held:
        held.step(truth=False)
        sim_control(d, delay_ms=60_000)  # the next turn waits at D
        ended: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: ended.update(turn=held.step(truth=False)))
        thread.start()
        wait_for(lambda: metric(gw.url, "turnkv_inflight_turns") == 1, what="the turn in flight")

        gw.proc.send_signal(signal.SIGTERM)  # the preStop's
        wait_for(lambda: ready(gw.url) == 503, what="/ready to fail")
        assert listening(gw.url) and metric(gw.url, "turnkv_draining") == 1  # still serving, not ready
        gw.proc.send_signal(signal.SIGTERM)  # the kubelet's, after the preStop
        wait_for(lambda: not listening(gw.url), what="the gateway to stop listening")
        assert gw.proc.poll() is None and thread.is_alive()  # the turn in flight holds it open

        sim_control(d, delay_ms=0)
        thread.join(60)
    # the stream ended without an error (an aborted turn ends with the shutting_down event, which the SDK
    # raises), and its record was stored before [DONE]
    assert ended["turn"].outcome == "full" and ended["turn"].answer["content"]
    assert c.turn_events(2)[-1]["capture"].startswith("stored")
    assert gw.proc.wait(60) is not None
