"""The P/D protocol between real sim processes on 127.0.0.1: one-way P->D and the bidirectional readback.

Requests are shaped as vLLM's proxies shape them (see ``helpers.prefill_body``/``decode_body``).
Every effect is read from a response, the sims' /metrics, or /_sim/state after the response
that caused it: the side-channel notification that frees a pin is sent before the reading
engine answers, so no waiting is needed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.sim.conftest import StartSims
from tests.sim.helpers import (
    P_KEYS_026,
    P_KEYS_033,
    Sim,
    answer,
    chat_body,
    decode_body,
    external_tokens,
    metric,
    next_turn,
    prefill_body,
    sse,
    stream_answer,
)

pytestmark = pytest.mark.integration

MESSAGES = [
    {"role": "system", "content": "You are a travel agent."},
    {"role": "user", "content": "Plan a trip to the mountains"},
]
INTERNAL = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}


def local_hits(sim: Sim) -> float:
    return metric(sim.metrics(), "vllm:prefix_cache_hits_total")


def turn(
    p: Sim, d: Sim, client: dict[str, Any], handle: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One non-streaming P/D turn: P's response body and D's."""
    p_body = p.chat(prefill_body(client, handle))
    return p_body, d.chat(decode_body(client, p_body["kv_transfer_params"]))


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
def test_prefill_handle_lease_and_decode_pull(sims: StartSims, compat: str) -> None:
    p, d = sims(("p", "prefill", "--vllm-compat", compat), ("d", "decode", "--vllm-compat", compat))
    client = chat_body(MESSAGES)
    p_body = p.chat(prefill_body(client))
    params = p_body["kv_transfer_params"]
    n = p_body["usage"]["prompt_tokens"]
    assert list(params) == (P_KEYS_033 if compat == "0.33" else P_KEYS_026)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == p.state()["engine_id"]
    assert params["remote_request_id"].startswith("chatcmpl-") and params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == p.state()["side_channel_port"]
    assert params["tp_size"] == 1 and params["remote_blocks_expiry_time"] is None
    assert params["remote_num_tokens"] == n and len(params["remote_block_ids"][0]) == -(-n // 16)
    if compat == "0.33":
        assert (params["dcp_size"], params["pp_size"], params["transfer_mode"]) == (1, 1, "pull")
    assert p_body["choices"][0]["finish_reason"] == "length" and p_body["usage"]["completion_tokens"] == 1
    assert p.state()["pins"] == 1  # P holds its blocks for the lease, until D reads them

    d_body = d.chat(decode_body(client, params))
    assert p.state()["pins"] == 0  # D's "done" notification freed them
    assert external_tokens(d.metrics()) == n  # D had nothing: it pulled the whole prompt
    assert d_body["prompt_token_ids"] == p.render(MESSAGES)

    # next turn: D already holds this conversation's blocks and pulls only what it lacks
    client2 = chat_body(next_turn(MESSAGES, d_body, "Somewhere warmer?"))
    hits, pulled = local_hits(d), external_tokens(d.metrics())
    p2, d2 = turn(p, d, client2)
    n2 = d2["usage"]["prompt_tokens"]
    local = local_hits(d) - hits
    assert local >= 16 * (n // 16) > 0
    assert external_tokens(d.metrics()) - pulled == n2 - local


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
def test_where_decode_returns_its_handle(sims: StartSims, compat: str) -> None:
    p, d = sims(("p", "prefill", "--vllm-compat", compat), ("d", "decode", "--vllm-compat", compat))
    client = chat_body(MESSAGES, stream_options={"include_usage": True})
    _, body = turn(p, d, client)
    handle = body["kv_transfer_params"]
    assert list(handle) == (P_KEYS_033 if compat == "0.33" else P_KEYS_026)
    assert handle["do_remote_decode"] is True and handle["do_remote_prefill"] is False
    assert handle["remote_engine_id"] == d.state()["engine_id"]
    assert handle["remote_num_tokens"] == body["usage"]["total_tokens"] - 1
    assert isinstance(handle["remote_blocks_expiry_time"], float)
    assert d.state()["pins"] == 1

    events = d.chat_stream(decode_body(client, p.chat(prefill_body(client))["kv_transfer_params"]))
    streamed, final_params = stream_answer(events)
    assert streamed["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    assert d.state()["pins"] == 2  # a streamed answer pins its blocks too, whether or not it says so
    if compat == "0.26":
        assert final_params is None and all("kv_transfer_params" not in e for e in events)
    else:
        assert final_params is not None and list(final_params) == P_KEYS_033
        assert final_params["remote_num_tokens"] == handle["remote_num_tokens"]
        assert final_params["remote_request_id"] != handle["remote_request_id"]


def test_without_bidirectional_decode_returns_no_handle(sims: StartSims) -> None:
    p, d = sims(("p", "prefill"), ("d", "decode", "--no-bidirectional"))
    _, body = turn(p, d, chat_body(MESSAGES))
    assert body["kv_transfer_params"] is None
    assert d.state()["pins"] == 0


def test_a_handle_is_single_use(sims: StartSims) -> None:
    """The first pull frees D's blocks; a second pull reads whatever those blocks hold by then."""
    p, d_a, d_b, c = sims(
        ("p", "prefill", "--no-prefix-caching", "--kv-recompute-threshold", "0"),
        ("d_a", "decode", "--num-gpu-blocks", "32"),
        ("d_b", "decode", "--no-prefix-caching"),
        ("c", "colocated"),
    )
    client = chat_body(MESSAGES)
    _, first = turn(p, d_a, client)
    handle = first["kv_transfer_params"]
    assert d_a.state()["pins"] == 1
    client2 = chat_body(next_turn(MESSAGES, first, "Somewhere warmer?"), max_tokens=40)
    truth = answer(c.chat(client2))

    _, good = turn(p, d_b, client2, handle)
    assert answer(good) == truth
    assert d_a.state()["pins"] == 0 and d_a.state()["free_blocks"] == 32  # freed after one read

    # another request now takes every block of D, the freed ones included
    filler = {"prompt": "Bada kesi lomu", "max_tokens": 512 - 3, "ignore_eos": True}
    assert d_a.post("/v1/completions", filler).status_code == 200
    pulled = external_tokens(p.metrics())
    _, stale = turn(p, d_b, client2, handle)
    assert external_tokens(p.metrics()) - pulled == handle["remote_num_tokens"]  # the read happened
    assert answer(stale)[0] != truth[0]  # from someone else's KV


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("how", ["expire_handles", "short_ttl"])
def test_reads_near_expiry_are_declined_and_the_policy_applies(sims: StartSims, policy: str, how: str) -> None:
    ttl = ["--decoder-kv-blocks-ttl", "4"] if how == "short_ttl" else []  # below the 5 s safety margin
    p, d, c = sims(
        ("p", "prefill", "--kv-load-failure-policy", policy, "--kv-recompute-threshold", "0"),
        ("d", "decode", *ttl),
        ("c", "colocated"),
    )
    _, first = turn(p, d, chat_body(MESSAGES))
    handle = first["kv_transfer_params"]
    if how == "expire_handles":
        assert d.faults(expire_handles=True)["expired_handles"] == 1
    client2 = chat_body(next_turn(MESSAGES, first, "Somewhere warmer?"))
    r = p.post("/v1/chat/completions", prefill_body(client2, handle))
    assert metric(p.metrics(), "vllm:nixl_num_kv_expired_reqs_total") == 1
    assert external_tokens(p.metrics()) == 0
    if policy == "fail":
        assert r.status_code == 500 and r.json() == INTERNAL
        return
    assert r.status_code == 200
    second = d.chat(decode_body(client2, r.json()["kv_transfer_params"]))
    assert answer(second) == answer(c.chat(client2))


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_after_a_restart_old_handles_fail_the_handshake(sims: StartSims, policy: str) -> None:
    p, d, c = sims(
        ("p", "prefill", "--kv-load-failure-policy", policy, "--kv-recompute-threshold", "0"),
        ("d", "decode", "--kv-load-failure-policy", policy),
        ("c", "colocated"),
    )
    client = chat_body(MESSAGES)
    _, first = turn(p, d, client)
    old_d = d.state()["engine_id"]
    new_d = d.faults(restart=True)["engine_id"]
    assert new_d != old_d
    assert d.state()["engine_id"] == new_d and d.state()["pins"] == 0
    client2 = chat_body(next_turn(MESSAGES, first, "Somewhere warmer?"))
    r = p.post("/v1/chat/completions", prefill_body(client2, first["kv_transfer_params"]))
    assert metric(p.metrics(), "vllm:nixl_num_failed_transfers_total") == 1
    if policy == "fail":
        assert r.status_code == 500 and r.json() == INTERNAL
    else:
        assert r.status_code == 200 and external_tokens(p.metrics()) == 0

    # the same for D with a handle of a P that restarted in between
    p_params = p.chat(prefill_body(client))["kv_transfer_params"]
    p.faults(restart=True)
    r = d.post("/v1/chat/completions", decode_body(client, p_params))
    if policy == "fail":
        assert r.status_code == 500 and r.json() == INTERNAL
    else:
        assert answer(r.json()) == answer(c.chat(client))


def test_fail_next_drop_next_and_delay(sims: StartSims, http: httpx.Client) -> None:
    (c,) = sims(("c", "colocated"))
    body = chat_body(MESSAGES, max_tokens=20, stream=True)
    assert c.faults(fail_next=1)["faults"]["fail_next"] == 1
    r = c.post("/v1/chat/completions", body)
    assert r.status_code == 500 and r.json() == INTERNAL
    assert c.post("/v1/chat/completions", body).status_code == 200

    c.faults(drop_next=1, drop_after_chunks=3)
    received: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        http.stream("POST", c.url + "/v1/chat/completions", json=body) as stream,
    ):
        for line in stream.iter_lines():
            received.append(line)
    data = [x for x in received if x.startswith("data: ")]
    assert len(data) == 4  # the role chunk and three token chunks, then the connection is gone
    assert "data: [DONE]" not in received
    assert sse(c.post("/v1/chat/completions", body).text)  # the next stream is whole


async def test_delay_holds_requests_until_lowered(sims: StartSims) -> None:
    (c,) = sims(("c", "colocated"))
    async with httpx.AsyncClient(base_url=c.url, timeout=30.0) as client:
        await client.post("/_sim/faults", json={"delay_ms": 600_000})
        held = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(MESSAGES, max_tokens=5)))
        for _ in range(500):  # the request reaches the sim asynchronously
            if (await client.get("/_sim/state")).json()["delayed"] == 1:
                break
            await asyncio.sleep(0.01)
        state = (await client.get("/_sim/state")).json()
        assert state["delayed"] == 1 and not held.done()
        assert (await client.get("/health")).status_code == 200  # only generation is delayed
        await client.post("/_sim/faults", json={"delay_ms": 0})
        r = await held
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert c.state()["delayed"] == 0
