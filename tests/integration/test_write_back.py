"""Write-back: a finished turn's KV goes from D's pin to P's prefix cache (``VllmEngine.write_back``).

P gets the turn's sequence (prompt and answer, as token ids) with D's handle as a remote prefill; it pulls
D's blocks (those its own cache lacks), caches them under the sequence's hashes, and its read tells D to
free them; closed at its first output, the request is aborted and P pins nothing. The next turn, which
extends the sequence, then finds it in P's prefix cache. Real HTTP on loopback to simulated engines that
follow vLLM 0.26's connector and scheduler in this, and whose KV encodes the tokens that produced it: a
write-back of ids that are not D's sequence caches D's blocks under the wrong ids, and the next answer
from them is wrong (the oracle sees it), as vLLM's would be.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import Dialogue, metric, sim_control, sim_state, start_cluster, wait_for
from turnkv import launch
from turnkv.config import Settings
from turnkv.engine.base import WriteBack, WriteBackResult
from turnkv.engine.vllm import handles, vllm_engine
from turnkv.errors import UpstreamError
from turnkv.sim.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

TOK = Tokenizer()
MODEL = "sim-model"
BLOCK = 16


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _ids(n: int, start: int) -> list[int]:
    return TOK.encode("".join(" " + w for w in TOK.words[start : start + n]))


def _turn(p: str, d: str, prompt: list[int], max_tokens: int = 40) -> tuple[list[int], dict[str, Any]]:
    """A turn through P and D: the sequence D's handle holds, and the handle."""
    params = _post(p, {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": dict(handles.P_ONLY)})
    out = _post(
        d,
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": params["kv_transfer_params"],
        },
    )
    handle: dict[str, Any] = out["kv_transfer_params"]
    seq = (prompt + out["choices"][0]["token_ids"])[: handle["remote_num_tokens"]]
    return seq, handle


def _answer(url: str, prompt: list[int], params: dict[str, Any] | None = None) -> list[int]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    ids: list[int] = _post(url, body)["choices"][0]["token_ids"]
    return ids


def _next_turn(p: str, d: str, prompt: list[int]) -> tuple[list[int], float]:
    """The next turn through P and D, nothing pulled: D's answer, and the prompt tokens P found cached."""
    hits = metric(p, "vllm:prefix_cache_hits_total")
    params = _post(p, {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": dict(handles.P_ONLY)})
    cached = metric(p, "vllm:prefix_cache_hits_total") - hits
    return _answer(d, prompt, params["kv_transfer_params"]), cached


def _write_back(p: str, d: str, call: WriteBack) -> WriteBackResult:
    async def go() -> WriteBackResult:
        async with vllm_engine(Settings(prefill=[p], decode=[d])) as engine:
            return await engine.write_back(p, call)

    return asyncio.run(go())


@pytest.fixture
def engines(procs: list[launch.Running], tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, str, str]:
    compat = getattr(request, "param", "0.26")
    # engines that take their time (a decode step ~8 ms): the write-back's abort reaches P within its tokens
    flags = ("--time-scale", "1", "--vllm-compat", compat)
    started = [
        launch.sim("prefill", "prefill", *flags, log_dir=tmp_path),
        launch.sim("decode", "decode", *flags, log_dir=tmp_path),
        launch.sim("truth", "colocated", *flags, log_dir=tmp_path),
    ]
    procs += started
    return started[0].url, started[1].url, started[2].url


@pytest.mark.parametrize("engines", ["0.26", "0.33"], indirect=True)
@pytest.mark.parametrize("p_cache", ["warm", "cold"])
def test_a_write_back_moves_ds_kv_into_ps_prefix_cache(engines: tuple[str, str, str], p_cache: str) -> None:
    p, d, truth = engines
    seq, handle = _turn(p, d, _ids(300, 0))
    n = len(seq)
    if p_cache == "cold":  # P's cache lost the prompt it computed: all of D's blocks are pulled
        sim_control(p, reset_prefix_cache=True)
    pulled = metric(p, "vllm:external_prefix_cache_hits_total")
    assert _write_back(p, d, WriteBack(handle, seq, MODEL, timeout_s=30)) is WriteBackResult.CACHED
    # P's local hit is the prompt's whole blocks when warm; it pulls the rest, its last block partial
    expect = n - (300 // BLOCK) * BLOCK if p_cache == "warm" else n - 1
    assert metric(p, "vllm:external_prefix_cache_hits_total") - pulled == pytest.approx(expect, abs=BLOCK)
    assert sim_state(d)["pins"] == 0  # P's read told D to free the blocks
    assert sim_state(p)["pins"] == 0  # and P holds no pin of its own: they are in its prefix cache

    nxt = seq + _ids(40, 500)
    answer, cached = _next_turn(p, d, nxt)
    assert cached == (n // BLOCK) * BLOCK  # the whole sequence's blocks, from P's prefix cache
    assert answer == _answer(truth, nxt)  # computed on D's KV as P cached it: right


def test_a_write_back_of_ids_that_are_not_ds_sequence_caches_wrong_kv(engines: tuple[str, str, str]) -> None:
    # vLLM checks nothing: D's blocks are cached under whatever ids P was sent. The sim's KV encodes the
    # tokens that produced it, so the next turn computed on them answers wrongly: the oracle catches it.
    p, d, truth = engines
    seq, handle = _turn(p, d, _ids(300, 0))
    sim_control(p, reset_prefix_cache=True)
    wrong = [*seq[:100], TOK.encode(" " + TOK.words[900])[0], *seq[101:]]
    _write_back(p, d, WriteBack(handle, wrong, MODEL, timeout_s=30))
    nxt = wrong + _ids(40, 500)
    answer, cached = _next_turn(p, d, nxt)
    assert cached == (len(wrong) // BLOCK) * BLOCK
    assert answer != _answer(truth, nxt)


def test_a_write_back_of_a_released_handle_fails_and_caches_nothing(engines: tuple[str, str, str]) -> None:
    p, d, _ = engines
    seq, handle = _turn(p, d, _ids(300, 0))
    sim_control(d, expire_handles=True)  # D's TTL has passed: P declines the read (policy fail)
    sim_control(p, reset_prefix_cache=True)
    with pytest.raises(UpstreamError):
        _write_back(p, d, WriteBack(handle, seq, MODEL, timeout_s=30))
    assert sim_state(p)["pins"] == 0
    _, cached = _next_turn(p, d, seq + _ids(40, 500))
    assert cached == 0


def test_a_conversation_through_the_gateway_keeps_nothing_pinned_between_turns(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # every handle written back (write_back.mode always): between turns D pins nothing and P holds no pin
    # either; each later turn finds its history in P's prefix cache and answers as the colocated engine does
    c = start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        policy="adaptive",
        sim_flags=("--time-scale", "1"),
        gateway_env={"TURNKV_WRITE_BACK__MODE": "always", "TURNKV_POLICY__PARAMS": '{"decode_local": false}'},
    )
    p, d = c.prefill[0].url, c.decode[0].url
    turns = []
    with Dialogue(c, session="wb-1", stream=True, max_tokens=32) as chat:
        for k in range(4):
            turns.append(chat.step())
            wait_for(
                lambda k=k: metric(c.gateway.url, "turnkv_write_backs_total", result="cached") == k + 1,
                what=f"write-back {k + 1}",
            )
            assert sim_state(d)["pins"] == 0 and sim_state(p)["pins"] == 0
    assert all(t.correct for t in turns)
    assert [t.reason for t in turns[1:]] == ["written_back"] * 3
    events = c.turn_events(4)
    assert [e["capture"] for e in events] == ["stored_write_back"] * 4
