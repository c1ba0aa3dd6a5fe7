"""What ``turnkv doctor`` learns of a vLLM engine (0.26-0.33) beside a turn's calls, and vLLM's fixes.

What vLLM exposes over HTTP: ``/version`` (and turnkv's plugin header: its version, the GPUs),
``/v1/models`` (names, ``max_model_len``), ``/metrics``'s ``vllm:cache_config_info`` (block size,
GPU blocks, prefix caching, memory share) and ``/tokenize`` (refused without a tokenizer:
``--tokens-only``). Its KV transfer config (``--kv-transfer-config``: connector, role,
``bidirectional_kv_xfer``, ``kv_recompute_threshold``, ``decoder_kv_blocks_ttl``,
``kv_lease_duration``, ``kv_load_failure_policy``) and its NIXL side channel are exposed only by the
development endpoint ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``); otherwise the start-up log says
whether bidirectional transfer is on, and a handle says where its engine serves blocks. UCX logs the
transports it set up with ``UCX_LOG_LEVEL=info`` ("intra-node cfg#N rma_am(tcp/lo) ..."), and vLLM
logs "KV Transfer metrics: ..." lines.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from turnkv.config import Settings
from turnkv.engine.base import CallMeta, Handle, ModelCard
from turnkv.engine.diagnostics import Advice, EngineDescription, LogFacts, TransferSettings, TransferTotals
from turnkv.engine.vllm.engine import VllmEngine, vllm_engine
from turnkv.engine.vllm.info import PLUGIN_HEADER, engine_info
from turnkv.errors import UpstreamError, UpstreamStatus

NO_TOKENIZER = "skip_tokenizer_init"  # in what vLLM answers a request that needs the tokenizer it lacks
_BIDIRECTIONAL = re.compile(
    r"Bidirectional KV transfer is enabled and the kv recompute threshold is set to (\d+) tokens\."
    r"\s*KV blocks on D are released after a TTL of (\d+) seconds"
)
_ROLE = re.compile(r"kv_role='(\w+)'")
_UCX_CFG = re.compile(r"(?:intra|inter)-node cfg#\d+ (.*)")
_LANE = re.compile(r"(\w+)\(([^)]*)\)")
_TRANSFER_LINE = re.compile(r"KV Transfer metrics: .*")
_TOTALS = {
    "vllm:nixl_xfer_time_seconds_count": "count",
    "vllm:nixl_xfer_time_seconds_sum": "seconds",
    "vllm:nixl_bytes_transferred_sum": "bytes",
    "vllm:nixl_num_failed_transfers_total": "failed",
}
_HOW = {
    "kv_transfer_config": "not exposed over HTTP: VLLM_SERVER_DEV_MODE=1 exposes GET /server_info; otherwise its "
    "--kv-transfer-config flag, and its start-up log says 'Bidirectional KV transfer is enabled' when it is "
    "(turnkv doctor --log ROLE=FILE reads it)",
    "kv_lease_duration": "not exposed: kv_connector_extra_config.kv_lease_duration (default 30 s; 120-300 s on "
    "both engines under load)",
    "kv_load_failure_policy": "not exposed: --kv-transfer-config kv_load_failure_policy (default 'fail': a pull "
    "that fails fails P's request; turnkv then retries without it)",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "not exposed: the engine's environment; the doctor reads the address from "
    "the handles its probes get",
}
ADVICE = {
    Advice.NO_CONNECTOR: "start P and D with a KV connector: --kv-transfer-config "
    '\'{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":'
    '{"bidirectional_kv_xfer":true}}\' (kv_consumer on D)',
    Advice.BIDIRECTIONAL_OFF_D: 'add "bidirectional_kv_xfer": true (a JSON boolean) to D\'s '
    "kv_connector_extra_config: only then does D return its own handle and keep its blocks for the next turn",
    Advice.BIDIRECTIONAL_OFF_P: 'add "bidirectional_kv_xfer": true (a JSON boolean) to P\'s '
    "kv_connector_extra_config: without it P accepts D's handle but never starts the read, and the request "
    "waits until it is aborted",
    Advice.TRANSFER_FAILED: "check each engine's NIXL side channel: VLLM_NIXL_SIDE_CHANNEL_HOST must be an address "
    "the other engine reaches (the default is localhost), VLLM_NIXL_SIDE_CHANNEL_PORT one per engine on a host; "
    "P and D must run the same vLLM version and model (NIXL's handshake compares them); NIXL_LOG_LEVEL=debug "
    "and UCX_LOG_LEVEL=info make the engines' logs say why",
    Advice.NO_TOKENIZER: "this engine runs --tokens-only (skip_tokenizer_init) and cannot render a chat: point "
    "turnkv's render: setting at an engine that has the tokenizer, or at a `vllm launch render` server",
    Advice.VERSIONS_DIFFER: "run one vLLM version on P and D: NIXL's handshake compares them (unless "
    "kv_connector_extra_config.enforce_handshake_compat is false)",
    Advice.SLOW_LINK_SAME_HOST: "UCX is likely moving KV over TCP: where GPUs have no NVLink between them, UCX's "
    "cuda_ipc serves no remote reads, and NIXL's pull connector reads. Set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y in "
    "both engines' environment (on one H200 it took KV from 0.45 to 5-350 GB/s), keep cuda_ipc and cuda_copy "
    "in UCX_TLS where it is set, and check with UCX_LOG_LEVEL=info which lanes UCX picked",
    Advice.SLOW_LINK_HOSTS: "across hosts NIXL needs RDMA to move KV at network speed: give the engines' "
    "containers the RDMA devices (/dev/infiniband; `ibv_devices` lists them), pick the NIC with "
    "UCX_NET_DEVICES (e.g. mlx5_0:1), and leave rc/ud (or NIXL's LIBFABRIC backend on EFA) available; "
    "without RDMA, UCX falls back to TCP (about 0.5-1 GB/s)",
    Advice.SAME_SIDE_CHANNEL: "give each engine on a host its own VLLM_NIXL_SIDE_CHANNEL_PORT (data-parallel "
    "ranks take the ports above it)",
    Advice.SHOW_TRANSPORTS: "start the engines with UCX_LOG_LEVEL=info and pass their logs: "
    "turnkv doctor --log prefill=FILE --log decode=FILE",
}


class VllmDiagnostics:
    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.upstream = engine.upstream

    async def describe(self, base: str) -> EngineDescription | None:
        try:
            _, raw, headers = await self.upstream.probe(base, "/version")
            version = str(json.loads(raw).get("version"))
        except (UpstreamError, ValueError, AttributeError):
            return None
        plugin = headers.get(PLUGIN_HEADER, "")
        info = engine_info(version, plugin, base=base, decode=False)
        cache = await self._cache_config(base)
        tokenizer, detail = await self._tokenizer(base)
        transfer = await self._server_info(base)
        cards = await self._models(base)
        unexposed = () if transfer is not None else tuple(_HOW.items())
        return EngineDescription(
            version=version,
            plugin=plugin.split(";")[0].strip() or None,
            gpus=info.gpus,
            models=tuple(cards),
            block_size=_int(cache.get("block_size")),
            num_blocks=_int(cache.get("num_gpu_blocks")),
            prefix_caching=_bool(cache.get("enable_prefix_caching")),
            memory_share=_float(cache.get("gpu_memory_utilization")),
            tokenizer=tokenizer,
            tokenizer_detail=detail,
            takes_prompt_ids=info.takes_prompt_ids,
            stream_handles=info.stream_handles,
            transfer=transfer,
            unexposed=unexposed,
        )

    async def _models(self, base: str) -> list[ModelCard]:
        try:
            return await self.engine.models(base) or []
        except (UpstreamError, ValueError, KeyError, AttributeError):
            return []

    async def _metrics(self, base: str) -> str | None:
        try:
            status, raw = await self.upstream.get(base, "/metrics")
        except UpstreamError:
            return None
        return raw.decode("utf-8", "replace") if status == 200 else None

    async def _cache_config(self, base: str) -> dict[str, str]:
        return cache_config(await self._metrics(base) or "")

    async def transfers(self, base: str) -> TransferTotals | None:
        text = await self._metrics(base)
        return None if text is None else transfer_totals(text)

    async def _tokenizer(self, base: str) -> tuple[bool | None, str]:
        try:
            await self.upstream.post_json("probe", base, "/tokenize", {"prompt": "hello"}, {})
        except UpstreamStatus as exc:
            text = str(exc) + json.dumps(exc.upstream_body)
            if NO_TOKENIZER in text:
                return False, "no tokenizer (--tokens-only: skip_tokenizer_init)"
            return None, f"/tokenize answered {exc.upstream_status}"
        except UpstreamError as exc:
            return None, f"/tokenize failed: {exc}"
        return True, "has its tokenizer"

    async def _server_info(self, base: str) -> TransferSettings | None:
        try:
            status, raw = await self.upstream.get(base, "/server_info?config_format=json")
            data = json.loads(raw) if status == 200 else None
        except (UpstreamError, ValueError):
            return None
        config = data.get("vllm_config") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(config, dict):
            return None
        env = data.get("vllm_env")
        return transfer_settings(config, env if isinstance(env, dict) else {})

    async def tokenize(self, base: str, text: str, model: str | None) -> list[int]:
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        if model:
            body["model"] = model
        data = await self.engine.api_post(base, "/tokenize", body, CallMeta())
        ids = data.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise UpstreamStatus(502, {"error": {"message": "tokenize returned no ids"}}, leg="probe", instance=base)
        return ids

    def handle_endpoint(self, handle: Handle) -> str | None:
        host, port = handle.get("remote_host"), handle.get("remote_port")
        return f"{host}:{port}" if host is not None and port is not None else None

    def read_log(self, text: str) -> LogFacts:
        return read_log(text)

    def advice(self, topic: Advice) -> str:
        return ADVICE[topic]


def cache_config(metrics: str) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels (the engine's CacheConfig, every value a string); {} without it."""
    try:
        for fam in text_string_to_metric_families(metrics):
            for s in fam.samples:
                if s.name == "vllm:cache_config_info":
                    return dict(s.labels)
    except ValueError:
        pass
    return {}


def transfer_totals(metrics: str) -> TransferTotals | None:
    """The NIXL transfer totals in vLLM's Prometheus text (zeros before its first transfer); None when the
    text cannot be parsed."""
    totals = dict.fromkeys(_TOTALS.values(), 0.0)
    try:
        for fam in text_string_to_metric_families(metrics):
            for s in fam.samples:
                if s.name in _TOTALS:
                    totals[_TOTALS[s.name]] += float(s.value)
    except ValueError:
        return None
    return TransferTotals(**totals)


def transfer_settings(config: Mapping[str, Any], env: Mapping[str, Any]) -> TransferSettings:
    """An engine's KV transfer settings from ``/server_info``'s ``vllm_config`` and ``vllm_env``."""
    kv = config.get("kv_transfer_config")
    port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    side = f"{env.get('VLLM_NIXL_SIDE_CHANNEL_HOST', 'localhost')}:{port}" if port is not None else None
    if not isinstance(kv, dict) or not kv.get("kv_connector"):
        return TransferSettings(connector="", side_channel=side)
    extra = kv.get("kv_connector_extra_config")
    extra = extra if isinstance(extra, dict) else {}
    return TransferSettings(
        connector=str(kv["kv_connector"]),
        role=_str(kv.get("kv_role")),
        # vLLM tests the flag for truth: the string "false" turns it on
        bidirectional=bool(extra.get("bidirectional_kv_xfer", False)),
        recompute_threshold=_int(extra.get("kv_recompute_threshold", 64)),
        decoder_ttl_s=_float(extra.get("decoder_kv_blocks_ttl", 480)),
        lease_s=_float(extra.get("kv_lease_duration", 30)),
        failure_policy=_str(kv.get("kv_load_failure_policy")),
        side_channel=side,
        buffer_device=_str(kv.get("kv_buffer_device")),
    )


def read_log(text: str) -> LogFacts:
    """The transports UCX set up (``UCX_LOG_LEVEL=info``), vLLM's transfer statistics lines, and the
    settings its start-up lines state."""
    transports: set[str] = set()
    remote: set[str] = set()
    emulated = False
    for m in _UCX_CFG.finditer(text):
        for lane, devices in _LANE.findall(m.group(1)):
            tls = {d.split("/")[0] for d in devices.split()}
            transports |= tls
            if lane.startswith("rma") and lane != "rma_am":
                remote |= tls
            emulated = emulated or lane == "rma_am"
    settings: dict[str, str] = {}
    if (b := _BIDIRECTIONAL.search(text)) is not None:
        settings.update(
            bidirectional_kv_xfer="true", kv_recompute_threshold=b.group(1), decoder_kv_blocks_ttl=b.group(2)
        )
    if (r := _ROLE.search(text)) is not None:
        settings["kv_role"] = r.group(1)
    lines = tuple(m.group(0).strip() for m in _TRANSFER_LINE.finditer(text))[-5:]
    return LogFacts(
        transports=frozenset(transports),
        remote_access=frozenset(remote),
        emulated=emulated and not remote,
        transfer_lines=lines,
        settings=settings,
    )


@contextlib.asynccontextmanager
async def vllm_diagnostics(settings: Settings) -> AsyncIterator[tuple[VllmEngine, VllmDiagnostics]]:
    """The engine (its own HTTP session) and its probes."""
    async with vllm_engine(settings) as engine:
        yield engine, VllmDiagnostics(engine)


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None and str(v) not in ("None", "") else None
    except (TypeError, ValueError):
        return None


def _float(v: Any) -> float | None:
    try:
        return float(v) if v is not None and str(v) not in ("None", "") else None
    except (TypeError, ValueError):
        return None


def _bool(v: Any) -> bool | None:
    return {"True": True, "False": False, "true": True, "false": False}.get(str(v)) if v is not None else None


def _str(v: Any) -> str | None:
    return str(v) if v is not None else None
