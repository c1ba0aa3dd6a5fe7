"""The gateway's HTTP endpoints: OpenAI-compatible chat and completions, models, the render engine's token
utilities and version, health, readiness and metrics.

Every request arrives authenticated (``edge.EdgeMiddleware`` left its ``Principal`` in the request's state).
A turn is checked whole here, before its conversation's record is claimed; its body goes to the engines
with the tenant's prefix-cache salt, so cached prompts are shared only within a tenant.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turnkv.engine.base import CallMeta
from turnkv.errors import ModelNotFound, ShuttingDown, UpstreamError, UpstreamUnavailable
from turnkv.gateway.auth import Principal, cache_salt, require_admin
from turnkv.gateway.body import (
    ChatBody,
    CompletionBody,
    check_model,
    check_output_length,
    read_json,
    validate,
)
from turnkv.gateway.fields import engine_body, engine_fields, shown
from turnkv.gateway.identity import conversation_of
from turnkv.gateway.services import Services
from turnkv.gateway.turn.driver import run_turn
from turnkv.gateway.turn.request import Turn
from turnkv.reuse.load import shared_gpu

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def services(request: Request) -> Services:
    svc: Services = request.state.services
    return svc


def principal(request: Request) -> Principal:
    who: Principal = request.state.principal
    return who


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


async def _body(svc: Services, request: Request) -> dict[str, Any]:
    s = svc.settings
    return await read_json(
        request, s.max_body_bytes, timeout_s=s.limits.body_timeout_s, max_depth=s.limits.max_json_depth
    )


def _prepare(svc: Services, request: Request, body: dict[str, Any], *, chat: bool) -> Turn:
    s = svc.settings
    who = principal(request)
    clean = engine_body(body, chat=chat, allowed=engine_fields(s))  # what may reach the engines
    parsed: ChatBody | CompletionBody = validate(body, ChatBody) if chat else validate(body, CompletionBody)
    check_model(body.get("model"), svc.models)
    model = body.get("model") or next(iter(svc.models), None)
    check_output_length(body, svc.catalog.model_len.get(model) if isinstance(model, str) else None)
    conversation = (
        conversation_of(
            request.headers,
            body,
            session_headers=s.session_headers,
            tenant=who.tenant,
            max_length=s.max_session_id_length,
            from_history=s.conversation_from_history,
        )
        if chat
        else None
    )
    svc.engine.check_request(body)
    clean["cache_salt"] = cache_salt(who.tenant, body.get("cache_salt"))
    return Turn.of(
        request_id=_request_id(request),
        body=clean,
        parsed=parsed,
        authorization=who.forward_authorization,
        conversation=conversation,
    )


def conversation_header(turn: Turn, response: Response) -> Response:
    """Where the turn's conversation came from (identity.py), for clients that want to see it."""
    response.headers["x-turnkv-conversation"] = turn.conversation.source if turn.conversation else "none"
    return response


async def _turn(request: Request, *, chat: bool) -> Response:
    svc = services(request)
    if svc.drain.refusing:
        raise ShuttingDown("the gateway is shutting down; send the turn again")
    turn = _prepare(svc, request, await _body(svc, request), chat=chat)
    response = await run_turn(svc, turn)
    return conversation_header(turn, response) if chat else response


async def chat_completions(request: Request) -> Response:
    return await _turn(request, chat=True)


async def completions(request: Request) -> Response:
    return await _turn(request, chat=False)


def _render_base(svc: Services) -> str:
    if svc.settings.render:
        return svc.settings.render
    inst = svc.router.pick("prefill")
    if inst is None:
        raise UpstreamUnavailable("no prefill engine is available", leg="render")
    return inst.url


async def _passthrough_post(request: Request, path: str) -> Response:
    """POST the client's JSON to the render engine (a prefill engine by default) and answer what it answers;
    its 4xx bodies pass as they are, its failures become ours."""
    svc = services(request)
    body = await _body(svc, request)
    check_model(body.get("model"), svc.models)
    meta = CallMeta(_request_id(request), principal(request).forward_authorization)
    data = await svc.engine.api_post(_render_base(svc), path, body, meta)
    return JSONResponse(data)


async def tokenize(request: Request) -> Response:
    return await _passthrough_post(request, "/tokenize")


async def detokenize(request: Request) -> Response:
    return await _passthrough_post(request, "/detokenize")


async def version(request: Request) -> Response:
    svc = services(request)
    status, raw = await svc.engine.api_get(_render_base(svc), "/version")
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
        "store": {"kind": "redis" if svc.settings.redis_url else "memory", "up": svc.store.up},
        "template": {"class": svc.catalog.template.cls.value, "detail": svc.catalog.template.detail},
        "policy": svc.policy.name,
        "shared_gpu": shared_gpus(svc),
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
