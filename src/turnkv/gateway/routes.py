"""The gateway's HTTP endpoints: OpenAI-compatible chat and completions, models, health and metrics."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turnkv.errors import ClientError, ShuttingDown, UpstreamError, UpstreamUnavailable
from turnkv.gateway.identity import BODY_FIELDS, conversation_of
from turnkv.gateway.requests import ChatBody, CompletionBody, check_model, read_json, validate
from turnkv.gateway.services import Services
from turnkv.gateway.turn.context import TurnContext, TurnState
from turnkv.gateway.turn.driver import run_turn

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def services(request: Request) -> Services:
    svc: Services = request.state.services
    return svc


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


def _prepare(svc: Services, request: Request, body: dict[str, Any], *, chat: bool) -> TurnContext:
    s = svc.settings
    validate(body, ChatBody if chat else CompletionBody)
    check_model(body.get("model"), s.models or svc.models)
    conversation = conversation_of(request.headers, body, session_headers=s.session_headers,
                                   tenant_header=s.tenant_header, max_length=s.max_session_id_length,
                                   from_history=s.conversation_from_history) if chat else None
    if "kv_transfer_params" in body and not s.allow_client_kv_transfer_params:
        raise ClientError("kv_transfer_params is set by turnkv, not by clients", param="kv_transfer_params")
    clean = {k: v for k, v in body.items() if k not in BODY_FIELDS}
    messages = body.get("messages") or []
    turn = 1 + sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
    ctx = TurnContext(
        svc=svc, request_id=_request_id(request), body=clean, stream=bool(body.get("stream")),
        authorization=request.headers.get("authorization"), conversation=conversation, turn_index=turn,
        path="/v1/chat/completions" if chat else "/v1/completions",
    )
    if not chat:
        ctx.state = TurnState.PREFILL
    return ctx


def conversation_header(ctx: TurnContext, response: Response) -> Response:
    """Where the turn's conversation came from (identity.py), for clients that want to see it."""
    response.headers["x-turnkv-conversation"] = ctx.conversation.source if ctx.conversation else "none"
    return response


async def _turn(request: Request, *, chat: bool) -> Response:
    svc = services(request)
    if svc.drain.refusing:
        raise ShuttingDown("the gateway is shutting down; send the turn again")
    body = await read_json(request, svc.settings.max_body_bytes)
    ctx = _prepare(svc, request, body, chat=chat)
    svc.drain.track(ctx, lambda: ctx.abort("shutdown"))
    response = await run_turn(ctx)
    return conversation_header(ctx, response) if chat else response


async def chat_completions(request: Request) -> Response:
    return await _turn(request, chat=True)


async def completions(request: Request) -> Response:
    return await _turn(request, chat=False)


async def models(request: Request) -> Response:
    svc = services(request)
    inst = svc.registry.pick("prefill")
    if inst is None:
        raise UpstreamUnavailable("no prefill engine is configured", leg="probe")
    try:
        status, raw = await svc.upstream.get(inst.url, "/v1/models")
    except UpstreamError:
        if not (svc.settings.models or svc.models):
            raise
        status, raw = 0, b""
    if status == 200:
        return Response(raw, media_type="application/json")
    now = int(time.time())
    names = svc.settings.models or svc.models
    return JSONResponse({"object": "list", "data": [
        {"id": n, "object": "model", "created": now, "owned_by": "turnkv"} for n in names]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    svc = services(request)

    def view(role: str) -> list[dict[str, Any]]:
        return [{"url": i.url, "healthy": i.healthy, "version": i.version, "in_flight": i.in_flight,
                 "running": i.running, "kv_cache_usage": i.kv_usage, "prefix_cache_factor": round(i.cache_factor, 3),
                 **({"stream_handles": i.stream_handles} if role == "decode" else {})}
                for i in svc.registry.role(role)]

    p, d = view("prefill"), view("decode")
    ok = any(i["healthy"] for i in p) and any(i["healthy"] for i in d) and not svc.drain.draining
    body = {
        "ready": ok, "prefill": p, "decode": d,
        "store": {"kind": "redis" if svc.settings.redis_url else "memory", "up": svc.store.up},
        "template": {"class": svc.audit.cls.value, "detail": svc.audit.detail},
        "policy": svc.policy.name,
    }
    return JSONResponse(body, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    return Response(services(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
