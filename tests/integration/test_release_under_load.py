"""A release frees D's blocks even while P's queue is stuck (the 64-conversation H200 deadlock).

vLLM's P runs a release only once its FCFS scheduler allocates it, and that scheduler stops at the first
waiting request it cannot allocate. Under load P's KV is leased to prefills D has no room to pull while
D is full of pins that only releases can free. ``VllmEngine.release`` sends the handle as a one-token
remote prefill and gives up on it after ``RELEASE_WAIT_S`` in P's queue: the abort tells D all the same.
Real HTTP on loopback to simulated engines that follow vLLM's scheduler and connector in this.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import sim_state, wait_for
from turnkv import launch
from turnkv.config import Settings
from turnkv.engine.vllm import handles, vllm_engine
from turnkv.sim.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

TOK = Tokenizer()
MODEL = "sim-model"
P_BLOCKS = 32  # 512 tokens: one leased prefill of 300 leaves too little for the next of 300


def _post(url: str, body: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _words(n: int, start: int) -> str:
    """``n`` words the simulator's tokenizer reads as one token each."""
    return "".join(" " + w for w in TOK.words[start : start + n])


def _prefill(p: str, prompt: str) -> dict[str, Any]:
    out = _post(p, {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": dict(handles.P_ONLY)})
    params: dict[str, Any] = out["kv_transfer_params"]
    return params


def _decode_handle(p: str, d: str) -> dict[str, Any]:
    """A turn through P and D: D's handle to its blocks, pinned on D."""
    prompt = _words(60, 0)
    out = _post(d, {"model": MODEL, "prompt": prompt, "max_tokens": 20, "kv_transfer_params": _prefill(p, prompt)})
    handle: dict[str, Any] = out["kv_transfer_params"]
    assert handle["do_remote_decode"] and sim_state(d)["pins"] == 1
    return handle


def _send_stuck(p: str) -> None:
    """A prompt P cannot allocate: it waits until P is stopped (its answer is then an error)."""
    with contextlib.suppress(OSError):
        _post(p, {"model": MODEL, "prompt": _words(300, 2000), "max_tokens": 1})


@pytest.mark.parametrize("form", ["remote_prefill", "proxy"])
def test_a_release_stuck_in_ps_queue_still_frees_d(procs: list[launch.Running], tmp_path: Path, form: str) -> None:
    flags = ("--time-scale", "0", "--vllm-compat", "0.26", "--kv-lease-duration", "600")
    p = launch.sim("prefill", "prefill", *flags, "--num-gpu-blocks", str(P_BLOCKS), log_dir=tmp_path)
    d = launch.sim("decode", "decode", *flags, log_dir=tmp_path)
    procs += [p, d]
    handle = _decode_handle(p.url, d.url)
    _prefill(p.url, _words(300, 1000))  # leased to a D that never pulls it: most of P's blocks
    stuck = threading.Thread(target=_send_stuck, args=(p.url,))
    stuck.start()  # cannot be allocated: P's queue stops there
    wait_for(lambda: sim_state(p.url)["blocked"] >= 1, what="P's queue stuck behind a prompt it cannot allocate")

    async def release() -> None:
        async with vllm_engine(Settings(prefill=[p.url], decode=[d.url])) as engine:
            if form == "remote_prefill":
                await engine.release(p.url, handle, MODEL)
            else:  # the proxy's form, as releases were sent before: given up on after the same wait
                body = {"model": MODEL, "prompt": ".", "max_tokens": 1, "stream": True}
                body["kv_transfer_params"] = handles.release_handle(handle)
                resp = await engine.upstream.open_stream("prefill", p.url, "/v1/completions", body, {})
                resp.close()

    asyncio.run(release())
    if form == "remote_prefill":
        wait_for(lambda: sim_state(d.url)["pins"] == 0, what="D frees the pin", state=lambda: sim_state(d.url))
        assert sim_state(d.url)["unrecognized_notices"] == 0
    else:
        wait_for(lambda: sim_state(p.url)["blocked"] == 1, what="P aborts the release in its queue")
        assert sim_state(d.url)["pins"] == 1  # nothing told D: its blocks stay until the TTL
    procs.remove(p)
    p.stop()  # ends the stuck request
    stuck.join(10)
