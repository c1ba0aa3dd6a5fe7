"""What the simulator shows of vLLM that ``turnkv doctor`` reads: the development endpoint
``/server_info``, and NIXL's transfer times (the transfer, not the handshake)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.sim.conftest import StartSims
from tests.sim.helpers import MODEL, chat_body, decode_body, metric, prefill_body
from turnkv.sim.app import create_sim_app
from turnkv.sim.costs import LINKS, CostModel, kv_bytes_per_token
from turnkv.sim.engine import EngineConfig
from turnkv.sim.settings import SimSettings


@contextlib.asynccontextmanager
async def client(role: str = "prefill", **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    s = SimSettings(engine=EngineConfig(role=role, costs=CostModel(time_scale=0)), **settings)
    app = create_sim_app(s)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as c,
    ):
        yield c


async def test_server_info_only_in_dev_mode() -> None:
    async with client() as c:
        assert (await c.get("/server_info")).status_code == 404
    async with client(role="decode", server_dev_mode=True) as c:
        info = (await c.get("/server_info", params={"config_format": "json"})).json()
        text = (await c.get("/server_info")).json()
    kv = info["vllm_config"]["kv_transfer_config"]
    assert (kv["kv_connector"], kv["kv_role"], kv["kv_load_failure_policy"]) == ("NixlConnector", "kv_consumer", "fail")
    assert kv["kv_connector_extra_config"] == {
        "bidirectional_kv_xfer": True,
        "kv_recompute_threshold": 64,
        "decoder_kv_blocks_ttl": 480.0,
        "kv_lease_duration": 30.0,
    }
    assert info["vllm_config"]["model_config"]["max_model_len"] == 40960
    assert isinstance(info["vllm_env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"], int)
    assert isinstance(text["vllm_config"], str)
    async with client(role="colocated", server_dev_mode=True) as c:
        info = (await c.get("/server_info", params={"config_format": "json"})).json()
    assert info["vllm_config"]["kv_transfer_config"] is None


@pytest.mark.integration
@pytest.mark.parametrize("link", ["rdma400", "nvlink"])
def test_a_transfer_is_timed_as_nixl_times_it(sims: StartSims, link: str) -> None:
    # at simulated speed: D's counted time is the link's (fixed cost plus bytes over bandwidth), without the
    # side channel's handshake or the simulator's own copying of the blocks
    p, d = sims(
        ("p", "prefill", "--time-scale", "1", "--link", link), ("d", "decode", "--time-scale", "1", "--link", link)
    )
    client_body = chat_body([{"role": "user", "content": "word " * 3000}])
    params = p.chat(prefill_body(client_body))["kv_transfer_params"]
    d.chat(decode_body(client_body, params))
    text = d.metrics()
    nbytes = metric(text, "vllm:nixl_bytes_transferred_sum", model_name=MODEL)
    seconds = metric(text, "vllm:nixl_xfer_time_seconds_sum", model_name=MODEL)
    assert nbytes == len(params["remote_block_ids"][0]) * 16 * kv_bytes_per_token("qwen3-8b")
    assert seconds == pytest.approx(LINKS[link].seconds(int(nbytes)), abs=1e-3)
