"""The gateway's HTTP endpoints: OpenAI-compatible chat and completions, models, the render engine's token
utilities and version, health, readiness and metrics.

Every request arrives authenticated (``edge.EdgeMiddleware`` left its ``Principal`` in the request's state).
A turn comes in the one way every front end's does (``intake``): checked whole before its conversation's
record is claimed, its body sent to the engines with the tenant's prefix-cache salt, so cached prompts are
shared only within a tenant.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turnkv.engine.base import CallMeta
from turnkv.errors import ModelNotFound, NotServed, UpstreamError, UpstreamStatus, UpstreamUnavailable
from turnkv.gateway.auth import require_admin
from turnkv.gateway.body import check_model
from turnkv.gateway.fields import shown
from turnkv.gateway.intake import (
    conversation_header,
    prepare_turn,
    principal,
    read_body,
    receive,
    request_id,
    services,
)
from turnkv.gateway.services import Services
from turnkv.gateway.turn.driver import run_turn
from turnkv.profile import priors_view
from turnkv.reuse.load import shared_gpu


async def _turn(request: Request, *, chat: bool) -> Response:
    received = await receive(request)
    turn = prepare_turn(received, completions=not chat)
    response = await run_turn(received.svc, turn)
    return conversation_header(turn, response) if chat else response


async def chat_completions(request: Request) -> Response:
    return await _turn(request, chat=True)


async def completions(request: Request) -> Response:
    return await _turn(request, chat=False)


async def _passthrough_post(request: Request, path: str) -> Response:
    """POST the client's JSON to the render engine (a prefill engine by default) and answer what it answers;
    its 4xx bodies pass as they are, its failures become ours."""
    svc = services(request)
    body = await read_body(svc, request)
    check_model(body.get("model"), svc.models)
    meta = CallMeta(request_id(request), principal(request).forward_authorization)
    data = await svc.engine.api_post(svc.render_base(), path, body, meta)
    return JSONResponse(data)


async def pooling(request: Request) -> Response:
    """Embeddings, scores, reranking, classification: passed to an engine that serves them (a pooling
    model's vLLM); where the engines do not (a generative model's), a clear 501, not the engine's 404."""
    path = request.url.path
    try:
        return await _passthrough_post(request, path)
    except UpstreamStatus as exc:
        if exc.upstream_status not in (404, 405):
            raise
        raise NotServed(
            f"The engines behind this gateway do not serve {path} (the model is not a pooling model)."
        ) from exc


async def not_served(request: Request) -> Response:
    """An endpoint of OpenAI's (or Anthropic's) API that turnkv does not serve: a 501 that says so."""
    raise NotServed(f"turnkv does not serve {request.method} {request.url.path}.")


async def tokenize(request: Request) -> Response:
    return await _passthrough_post(request, "/tokenize")


async def detokenize(request: Request) -> Response:
    return await _passthrough_post(request, "/detokenize")


async def version(request: Request) -> Response:
    svc = services(request)
    status, raw = await svc.engine.api_get(svc.render_base(), "/version")
    if status != 200:
        raise UpstreamError(f"render engine answered HTTP {status} for /version", leg="render")
    return Response(raw, media_type="application/json")


async def _engine_models(svc: Services) -> bytes | None:
    """A prefill engine's ``/v1/models`` body; None when it cannot say and the names are known anyway."""
    inst = svc.router.pick("prefill")
    if inst is None:
        if svc.models:
            return None
        raise UpstreamUnavailable("no prefill engine is available", leg="probe")
    try:
        status, raw = await svc.engine.api_get(inst.url, "/v1/models")
    except UpstreamError:
        if not svc.models:
            raise
        return None
    return raw if status == 200 else None


def _listed(svc: Services) -> dict[str, Any]:
    now = int(time.time())
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": now, "owned_by": "turnkv"} for n in svc.models],
    }


async def models(request: Request) -> Response:
    svc = services(request)
    raw = await _engine_models(svc)
    if raw is not None:
        return Response(raw, media_type="application/json")
    return JSONResponse(_listed(svc))


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}``: that entry of the list, or OpenAI's 404."""
    svc = services(request)
    wanted = request.path_params["model_id"]
    raw = await _engine_models(svc)
    try:
        listed = json.loads(raw) if raw is not None else _listed(svc)
    except ValueError:
        listed = _listed(svc)
    entries = listed.get("data") if isinstance(listed, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("id") == wanted:
            return JSONResponse(entry)
    raise ModelNotFound(f"The model `{shown(wanted)}` does not exist.", param="model")


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    svc = services(request)

    def view(role: str) -> list[dict[str, Any]]:
        return [
            {
                "url": i.url,
                "healthy": i.healthy,
                "version": i.version,
                "in_flight": i.in_flight,
                "running": i.running,
                "waiting": i.waiting,
                "kv_cache_usage": i.kv_usage,
                "prefix_cache_factor": round(i.cache_factor, 3),
                "gpus": sorted(i.gpus),
                **({"stream_handles": i.stream_handles} if role == "decode" else {}),
            }
            for i in svc.fleet.views(role)
        ]

    p, d = view("prefill"), view("decode")
    ok = any(i["healthy"] for i in p) and any(i["healthy"] for i in d) and not svc.drain.draining
    if not principal(request).admin:  # engine URLs and load are an operator's business
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)
    body = {
        "ready": ok,
        "prefill": p,
        "decode": d,
        "store": {
            "kind": "redis" if svc.settings.redis_url else "memory",
            "up": svc.store.up,
            "nodes_down": svc.store.down(),  # the nodes whose breakers are open
        },
        "template": {"class": svc.catalog.template.cls.value, "detail": svc.catalog.template.detail},
        "policy": svc.policy.name,
        "shared_gpu": shared_gpus(svc),
        "cost_priors": priors_view(svc.estimator.prior, svc.settings.measured, svc.settings.profile),
    }
    return JSONResponse(body, status_code=200 if ok else 503)


def shared_gpus(svc: Services) -> dict[str, Any]:
    """The setting ``shared_gpu``, and the P and D pairs it makes share a GPU (``reuse.load.shared_gpu``)."""
    setting = svc.settings.shared_gpu
    pairs = [
        [p.url, d.url]
        for p in svc.fleet.views("prefill")
        for d in svc.fleet.views("decode")
        if shared_gpu(setting, p, d)[0]
    ]
    return {"setting": setting, "pairs": pairs}


async def metrics(request: Request) -> Response:
    require_admin(principal(request))
    return Response(services(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
