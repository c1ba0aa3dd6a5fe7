"""The plugin on vLLM >= 0.33 (``endpoint``): the GPUs through vLLM's endpoint-plugin seam, on a Starlette app
built the way vLLM 0.33 builds its own (``attach_router`` while it is built, ``init_state`` once the server's
arguments are known)."""

from __future__ import annotations

import asyncio
import importlib
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from vllm_turnkv import hooks
from vllm_turnkv.endpoint import TurnkvEndpoint
from vllm_turnkv.middleware import HEADER


def app() -> Starlette:
    return Starlette(routes=[Route("/version", lambda r: PlainTextResponse('{"version":"0.33.0"}'))])


def test_the_header_names_the_gpus_once_the_server_arguments_are_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hooks.VISIBLE_ENV, "GPU-aaaa,GPU-bbbb")
    a, plugin = app(), TurnkvEndpoint()
    plugin.attach_router(a)
    with TestClient(a) as client:
        assert HEADER not in client.get("/version").headers  # nothing said before init_state
        asyncio.run(plugin.init_state(None, State(), SimpleNamespace(tensor_parallel_size=2)))
        assert client.get("/version").headers[HEADER] == "0.1.0; streams=; gpus=GPU-aaaa,GPU-bbbb"


def test_the_header_names_the_patched_generate_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hooks.VISIBLE_ENV, raising=False)
    monkeypatch.setattr(hooks, "load_nvml", lambda: None)
    monkeypatch.setattr(hooks.STATE, "patched", ["generate"])
    a, plugin = app(), TurnkvEndpoint()
    plugin.attach_router(a)
    asyncio.run(plugin.init_state(None, State(), SimpleNamespace()))
    with TestClient(a) as client:
        assert client.get("/version").headers[HEADER] == "0.1.0; streams=generate"


def test_no_header_where_no_gpu_can_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hooks.VISIBLE_ENV, raising=False)  # and no NVML here
    monkeypatch.setattr(hooks, "load_nvml", lambda: None)
    a, plugin = app(), TurnkvEndpoint()
    plugin.attach_router(a)
    asyncio.run(plugin.init_state(None, State(), SimpleNamespace()))
    with TestClient(a) as client:
        assert HEADER not in client.get("/version").headers


def test_the_entry_points_resolve() -> None:
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    points = meta["project"]["entry-points"]
    module, _, attr = points["vllm.endpoint_plugins"]["turnkv"].partition(":")
    factory = getattr(importlib.import_module(module), attr)
    plugin = factory()  # vLLM calls it with no arguments
    assert plugin.name == "turnkv" and plugin.required_tasks is None
    assert points["vllm.general_plugins"]["turnkv"] == "vllm_turnkv:register"
