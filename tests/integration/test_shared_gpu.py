"""Whether P and D share a GPU, as the engines say it: simulated engines over real HTTP that name
their GPUs as turnkv's vLLM plugin names a real engine's (``x-turnkv-plugin: ...; gpus=GPU-...``), a gateway
left at ``shared_gpu: auto``, the openai SDK as client, every answer checked against a colocated engine's.

One P on GPU-0; D0 on the same GPU, D1 on GPU-1. The gateway must tell the two pairs apart by itself, show
it in ``/ready``, and tell the policy per turn (the turn log's ``load.shared_gpu``, with where it came from)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.integration.cluster import Dialogue, start_cluster, wait_for
from turnkv import launch

pytestmark = pytest.mark.integration
CONVERSATIONS = 6


def test_the_gateway_tells_from_the_engines_which_p_and_d_share_a_gpu(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    c = start_cluster(
        procs,
        tmp_path,
        policy="adaptive",
        n_decode=2,
        engine_flags={"prefill0": ("--gpu", "GPU-0"), "decode0": ("--gpu", "GPU-0"), "decode1": ("--gpu", "GPU-1")},
        gateway_env={"TURNKV_ROUTING": "round-robin"},  # conversations on both Ds
    )
    p, d0, d1 = c.prefill[0].url, c.decode[0].url, c.decode[1].url
    ready: dict[str, object] = {}

    def told() -> bool:
        nonlocal ready
        ready = httpx.get(c.gateway.url + "/ready", timeout=5).json()
        return all(e["gpus"] for role in ("prefill", "decode") for e in ready[role])  # type: ignore[attr-defined]

    wait_for(told, what="the gateway to learn every engine's GPUs", state=lambda: ready)
    assert {e["url"]: e["gpus"] for e in ready["decode"]} == {d0: ["GPU-0"], d1: ["GPU-1"]}  # type: ignore[attr-defined]
    assert ready["shared_gpu"] == {"setting": "auto", "pairs": [[p, d0]]}

    dialogues = [Dialogue(c, session=f"conv-{i}", max_tokens=24) for i in range(CONVERSATIONS)]
    try:
        turns = [d.step() for d in dialogues] + [d.step() for d in dialogues]
    finally:
        for d in dialogues:
            d.__exit__()
    assert all(t.correct for t in turns)
    events = c.turn_events(2 * CONVERSATIONS)
    later = [e for e in events if e["turn"] >= 2 and e["load"] is not None]
    assert later, events
    assert {e["decode"] for e in events} == {d0, d1}
    for e in later:
        assert e["load"]["shared_gpu"] is (e["decode"] == d0), e
        assert e["load"]["sources"]["shared_gpu"] == "engines", e
