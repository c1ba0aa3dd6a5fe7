"""Four hops by hand, the way a router drives them: render, tokens-only P, tokens-only D, derender.

P gets render's ``GenerateRequest`` with ``max_tokens: 1``, not streamed, and ``do_remote_decode`` (plus
D's previous handle, flipped, on a later turn); D gets it unchanged with P's params. Where the params go
is the engines' version's: 0.26-0.28 read them only from ``sampling_params.extra_args``, 0.29+ at the top.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import httpx

from tests.sim.helpers import MODEL, Sim, sse

FIRST_P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def with_kv(gen: dict[str, Any], params: dict[str, Any] | None, compat: str) -> dict[str, Any]:
    """A generate request carrying ``params`` where an engine of ``compat`` reads them."""
    out = copy.deepcopy(gen)
    if params is None:
        return out
    if compat == "0.26":
        sp = out["sampling_params"]
        sp["extra_args"] = {**(sp.get("extra_args") or {}), "kv_transfer_params": params}
    else:
        out["kv_transfer_params"] = params
    return out


def prefill_request(gen: dict[str, Any], handle: dict[str, Any] | None, compat: str) -> dict[str, Any]:
    params = FIRST_P_PARAMS if handle is None else {**handle, "do_remote_decode": True, "do_remote_prefill": False}
    body = with_kv(gen, params, compat)
    body["sampling_params"]["max_tokens"] = 1
    body["sampling_params"].pop("min_tokens", None)
    body.update(stream=False, stream_options=None)
    return body


@dataclass
class Turn:
    message: dict[str, Any]  # derender's message
    finish_reason: str
    prompt_ids: list[int]  # render's ids: what P and D computed from
    output_ids: list[int]
    handle: dict[str, Any] | None  # D's, for the next turn

    @property
    def sequence(self) -> list[int]:
        """The tokens whose KV D holds: the prompt and the answer but its last sampled token."""
        return self.prompt_ids + self.output_ids[:-1]


@dataclass
class FourHops:
    render: Sim
    p: Sim
    d: Sim
    compat: str

    def post(self, sim: Sim, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = sim.post(path, body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def turn(self, client: dict[str, Any], handle: dict[str, Any] | None, *, stream: bool = False) -> Turn:
        gen = self.post(self.render, "/v1/chat/completions/render", client)
        p_params = self.post(self.p, "/inference/v1/generate", prefill_request(gen, handle, self.compat))[
            "kv_transfer_params"
        ]
        assert p_params is not None and p_params["do_remote_prefill"] is True
        d_req = with_kv(gen, p_params, self.compat)
        d_req["stream"] = stream
        if stream:
            out, finish, d_handle = self.stream(d_req)
            response = {
                "request_id": gen["request_id"],
                "choices": [{"index": 0, "finish_reason": finish, "token_ids": out}],
            }
        else:
            response = self.post(self.d, "/inference/v1/generate", d_req)
            out, finish = response["choices"][0]["token_ids"], response["choices"][0]["finish_reason"]
            d_handle = response["kv_transfer_params"]
        derender: dict[str, Any] = {"model": MODEL, "generate_response": response, "chat_request": client}
        if self.compat == "0.26":
            derender["prompt_tokens"] = len(gen["token_ids"])
        else:
            derender["prompt_token_ids"] = gen["token_ids"]
        body = self.post(self.render, "/v1/chat/completions/derender", derender)
        return Turn(body["choices"][0]["message"], body["choices"][0]["finish_reason"], gen["token_ids"], out, d_handle)

    def stream(self, d_req: dict[str, Any]) -> tuple[list[int], str, dict[str, Any] | None]:
        r = self.d.http.post(self.d.url + "/inference/v1/generate", json=d_req)
        assert r.status_code == 200, r.text
        chunks = sse(r.text)
        out = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
        final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]
        return out, final["choices"][0]["finish_reason"], final.get("kv_transfer_params")


def generate_stream(http: httpx.Client, url: str, body: dict[str, Any]) -> list[Any]:
    r = http.post(url + "/inference/v1/generate", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return sse(r.text)
