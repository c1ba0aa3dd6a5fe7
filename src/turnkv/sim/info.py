"""The simulated engine's routes other than generation: token utilities, metadata and control.

Decides what ``/v1/chat/completions/render``, ``/tokenize``, ``/detokenize``, ``/v1/models``,
``/health``, ``/version`` and ``/metrics`` answer, in vLLM's shapes, and
what the simulator's own ``/_sim/faults`` and ``/_sim/state`` do.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turnkv.sim.faults import FaultUpdate
from turnkv.sim.requests import ApiError, ChatRequest, check_model, json_body, parse_body, validate
from turnkv.sim.responses import random_uuid

PLUGIN_HEADER = "x-turnkv-plugin"  # as turnkv's vLLM plugin (plugins/vllm-turnkv) sets it on a real engine

if TYPE_CHECKING:
    from turnkv.sim.app import SimServer


def sampling_params(req: ChatRequest, limit: int, kv: dict[str, Any] | None, compat: str) -> dict[str, Any]:
    """``SamplingParams`` as msgspec writes it with ``omit_defaults``: only non-default fields, in
    struct order."""
    # As recorded from vLLM 0.26 (tests/fixtures/vllm): the model's default sampling parameters come
    # first, even where they equal SamplingParams' own defaults.
    sp: dict[str, Any] = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "stop": [],
        "stop_token_ids": [],
    }
    if req.ignore_eos:
        sp["ignore_eos"] = True
    if limit != 16:
        sp["max_tokens"] = limit
    if req.min_tokens:
        sp["min_tokens"] = req.min_tokens
    # no skip_special_tokens: the recording's engines ran without --reasoning-parser, which adds it as false
    sp.update(output_kind=1 if req.stream else 2, skip_clone=True)
    if kv and compat == "0.26":
        sp["extra_args"] = {"kv_transfer_params": kv}
    sp.update(bad_words=[], skip_reading_prefix_cache=False)
    return sp


def server_config(s: SimServer) -> dict[str, Any]:
    """The parts of vLLM's ``VllmConfig`` (as ``/server_info?config_format=json`` dumps it) that describe
    what a router depends on: the model, the KV cache, and the KV transfer config with the NIXL connector's
    extra keys (``bidirectional_kv_xfer``, ``kv_recompute_threshold``, ``decoder_kv_blocks_ttl``,
    ``kv_lease_duration``)."""
    e = s.settings.engine
    connector = e.has_connector
    role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(e.role)
    return {
        "model_config": {
            "model": s.settings.model,
            "served_model_name": s.settings.model,
            "max_model_len": e.max_model_len,
            "skip_tokenizer_init": s.settings.tokens_only,
        },
        "cache_config": {
            "block_size": e.block_size,
            "num_gpu_blocks": e.num_blocks,
            "enable_prefix_caching": e.prefix_caching,
            "cache_dtype": "auto",
        },
        "kv_transfer_config": {
            "kv_connector": "NixlConnector" if connector else None,
            "engine_id": s.engine.engine_id,
            "kv_buffer_device": "cuda",
            "kv_role": role if connector else None,
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": e.bidirectional,
                "kv_recompute_threshold": e.kv_recompute_threshold,
                "decoder_kv_blocks_ttl": e.decoder_kv_blocks_ttl,
                "kv_lease_duration": e.kv_lease_duration,
            }
            if connector
            else {},
            "kv_load_failure_policy": e.kv_load_failure_policy,
        }
        if connector
        else None,
    }


class InfoRoutes:
    def __init__(self, server: SimServer) -> None:
        self.s = server
        self.renders = 0  # render calls served, in /_sim/state (a gateway may skip them)

    async def render(self, request: Request) -> Response:
        s = self.s
        self.renders += 1
        try:
            req = await parse_body(request, ChatRequest)
            s.note_private(req)
            check_model(req.model, s.settings.model)
            ids, _, text_prompt = s.chat_prompt(req)
            limit = s.chat_max_tokens(req, len(ids), text_prompt)
            await s.tokenizing(len(ids) if text_prompt else 0)
        except ApiError as exc:
            return exc.response()
        kv = {k: v for k, v in (req.kv_transfer_params or {}).items() if k != "prompt_token_ids"} or None
        compat = s.settings.engine.compat
        return JSONResponse(
            {
                "request_id": f"chatcmpl-{random_uuid()}",
                "token_ids": ids,
                "assistant_tokens_mask": None,
                "token_offsets": None,
                "features": None,
                "sampling_params": sampling_params(req, limit, kv, compat),
                "model": req.model or s.settings.model,
                "stream": bool(req.stream),
                "stream_options": req.stream_options if req.stream else None,
                "cache_salt": req.cache_salt,
                "priority": 0,
                # 0.26 leaves kv_transfer_params in sampling_params.extra_args; 0.33 hoists it here.
                "kv_transfer_params": kv if compat == "0.33" else None,
                "ec_transfer_params": None,
            }
        )

    async def tokenize(self, request: Request) -> Response:
        s = self.s
        try:
            body = await json_body(request)
            if isinstance(body, dict) and "messages" in body:
                req = validate({"add_generation_prompt": True, **body}, ChatRequest)
                check_model(req.model, s.settings.model)
                ids, _ = s.render_chat(req)
            elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
                check_model(body.get("model"), s.settings.model)
                ids = s.tok.encode(body["prompt"])
            else:
                raise ApiError(400, "tokenize takes 'messages' or a string 'prompt'")
        except ApiError as exc:
            return exc.response()
        strs = [s.tok.decode([i]) for i in ids] if body.get("return_token_strs") else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": s.settings.engine.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await json_body(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ApiError(400, "detokenize takes 'tokens': a list of ids")
            self.s.check_ids(tokens)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"prompt": self.s.tok.decode(tokens)})

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        st = self.s.settings
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": st.model,
                        "object": "model",
                        "created": now,
                        "owned_by": "vllm",
                        "root": st.model,
                        "parent": None,
                        "max_model_len": st.engine.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{random_uuid()}",
                                "object": "model_permission",
                                "created": now,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        st = self.s.settings
        parts = ["sim"]
        if st.turnkv_plugin:
            parts.append("streams=generate" if st.tokens_only else "streams=")
        if st.gpus:
            parts.append(f"gpus={','.join(st.gpus)}")
        headers = {PLUGIN_HEADER: "; ".join(parts)} if len(parts) > 1 else None
        return JSONResponse({"version": st.version}, headers=headers)

    async def server_info(self, request: Request) -> Response:
        """vLLM's development endpoint (``VLLM_SERVER_DEV_MODE=1``): the engine's config, in the shape of
        ``/server_info?config_format=json`` (``vllm_config`` as pydantic dumps VllmConfig, with the
        fields a router reads), or as text by default. 404 without dev mode, as vLLM registers no route."""
        if not self.s.settings.server_dev_mode:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        config = server_config(self.s)
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.s.settings.engine.side_channel_host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": self.s.engine.side_channel_port,
            "VLLM_SERVER_DEV_MODE": True,
        }
        as_json = request.query_params.get("config_format") == "json"
        return JSONResponse({"vllm_config": config if as_json else str(config), "vllm_env": env, "system_env": {}})

    async def metrics(self, request: Request) -> Response:
        self.s.engine.report_load()  # pins freed and requests blocked between steps count now
        return Response(self.s.metrics.render(), headers={"content-type": CONTENT_TYPE_LATEST})

    # -- simulator control -------------------------------------------------------------------
    async def set_faults(self, request: Request) -> Response:
        try:
            upd = await parse_body(request, FaultUpdate)
        except ApiError as exc:
            return exc.response()
        s = self.s
        s.faults.update(upd)
        expired = s.engine.expire_handles() if upd.expire_handles else 0
        if upd.restart:
            s.engine.restart()
        if upd.reset_prefix_cache:
            s.engine.reset_prefix_cache()
        return JSONResponse(
            {"faults": s.faults.faults.model_dump(), "engine_id": s.engine.engine_id, "expired_handles": expired}
        )

    async def state(self, request: Request) -> Response:
        s, e = self.s, self.s.engine
        return JSONResponse(
            {
                "engine_id": e.engine_id,
                "role": s.settings.engine.role,
                "compat": s.settings.engine.compat,
                "side_channel_port": e.side_channel_port,
                "pins": len(e.pins),
                "pinned_tokens": e.pinned_tokens(),
                "untracked_pins": sum(1 for p in e.pins.values() if not p.tracked),
                "unrecognized_notices": e.connector.unrecognized_notices,
                "blocked": e.blocked,
                "kv_cache_usage": e.pool.usage(),
                "free_blocks": e.pool.num_free,
                "faults": s.faults.faults.model_dump(),
                "delayed": s.faults.delayed,
                "renders": self.renders,
                "private_fields": dict(s.private_fields),
            }
        )


def routes(server: SimServer) -> list[Route]:
    r = InfoRoutes(server)
    return [
        Route("/v1/chat/completions/render", r.render, methods=["POST"]),
        Route("/tokenize", r.tokenize, methods=["POST"]),
        Route("/detokenize", r.detokenize, methods=["POST"]),
        Route("/v1/models", r.models, methods=["GET"]),
        Route("/health", r.health, methods=["GET"]),
        Route("/version", r.version, methods=["GET"]),
        Route("/metrics", r.metrics, methods=["GET"]),
        Route("/server_info", r.server_info, methods=["GET"]),
        Route("/_sim/faults", r.set_faults, methods=["POST"]),
        Route("/_sim/state", r.state, methods=["GET"]),
    ]
