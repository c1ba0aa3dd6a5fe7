"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: a Messages request runs as a chat turn.

Create: the request comes in as every turn does (``intake.receive``), its body is checked (``models``) and
translated into a chat request (``translate``), which becomes a turn (``intake.prepare_turn``: its
conversation found as for chat, from ``X-Session-ID``, ``metadata.conversation_id`` or its history) and
runs through ``turn.driver.run_turn``. The chat answer becomes a Message (JSON) or Anthropic's stream
events (``events``), with the turn's decision headers and ``request-id``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from turnkv.engine.base import CallMeta
from turnkv.gateway.auth import cache_salt
from turnkv.gateway.intake import conversation_header, prepare_turn, receive
from turnkv.gateway.messages import events, models, translate
from turnkv.gateway.reframe import Event, reframed
from turnkv.gateway.turn.driver import run_turn


def _headers(answer: Response, request_id: str) -> dict[str, str]:
    h = {k: v for k, v in answer.headers.items() if k.startswith("x-")}
    h["request-id"] = request_id
    return h


async def create(request: Request) -> Response:
    received = await receive(request)
    req: models.MessagesBody = models.parse(received.body)
    body = translate.chat_body(req)
    turn = prepare_turn(received, body, messages=body["messages"])
    reply = translate.Reply(translate.new_id(), req.model, req.stop_sequences)
    answer = await run_turn(received.svc, turn)
    if not isinstance(answer, StreamingResponse):
        message = translate.message_object(reply, json.loads(bytes(answer.body)))
        return conversation_header(turn, JSONResponse(message, headers=_headers(answer, turn.request_id)))
    answer.headers["request-id"] = turn.request_id
    answer.body_iterator = _translated(answer.body_iterator, events.MessageStream(reply))
    return conversation_header(turn, answer)


def _translated(chat: Any, stream: events.MessageStream) -> AsyncIterator[bytes]:
    """The relayed chat stream as Anthropic's events."""

    async def finish() -> list[Event]:
        return [] if stream.done else stream.finish()

    return reframed(chat, stream.start, stream.chunk, finish)


async def count_tokens(request: Request) -> Response:
    """The prompt's length as the engines render it (Anthropic's ``count_tokens``)."""
    received = await receive(request)
    req: models.CountTokensBody = models.parse(received.body, models.CountTokensBody)
    body = translate.chat_body(req)
    body["cache_salt"] = cache_salt(received.who.tenant, None)
    svc = received.svc
    meta = CallMeta(received.request_id, received.who.forward_authorization)
    ids = await svc.engine.render(svc.render_base(), body, meta)
    return JSONResponse({"input_tokens": len(ids)}, headers={"request-id": received.request_id})
