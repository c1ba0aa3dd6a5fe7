"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: a Responses request runs as a chat turn.

Create: the request comes in as every turn does (``intake.receive``), its body is checked (``models``),
the previous response's history is read back (tenant-scoped: another tenant's id is not found), the
request becomes a chat request (``translate``) and a turn (``intake.prepare_turn``: its conversation is
found as for chat, a ``previous_response_id`` claiming the record its response stored), and the turn runs
through ``turn.driver.run_turn``, the pipeline every chat turn takes. The chat answer is turned into a
Response (JSON) or into the Responses stream events (``events``); the response is stored, unless
``store: false``, before the client sees it complete, so a next request sent at once finds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from turnkv.errors import ClientError, GatewayError, StoreError
from turnkv.gateway.fields import shown
from turnkv.gateway.intake import conversation_header, prepare_turn, principal, receive, services
from turnkv.gateway.reframe import Event, reframed
from turnkv.gateway.responses import events, models, translate
from turnkv.gateway.services import Services
from turnkv.gateway.turn.driver import run_turn
from turnkv.gateway.turn.request import Turn

log = logging.getLogger("turnkv.responses")


class ResponseNotFound(ClientError):
    status = 404


class StoreUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "store_unavailable"


def _doc_key(tenant: str, resp_id: str) -> str:
    return "response:" + hashlib.blake2b(f"{tenant}\x00{resp_id}".encode(), digest_size=16).hexdigest()


async def _previous(svc: Services, tenant: str, resp_id: str) -> dict[str, Any]:
    try:
        raw = await svc.store.documents.get(_doc_key(tenant, resp_id))
    except StoreError as exc:
        raise StoreUnavailable(
            "the response store is unavailable: previous_response_id cannot be read now", param="previous_response_id"
        ) from exc
    doc = json.loads(raw) if raw else None
    if not isinstance(doc, dict) or doc.get("tenant") != tenant:
        err = ClientError(f"Previous response with id '{shown(resp_id)}' not found.", param="previous_response_id")
        err.code = "previous_response_not_found"
        raise err
    return doc


async def _store(
    svc: Services,
    req: models.ResponsesBody,
    tenant: str,
    response: dict[str, Any],
    history: list[dict[str, Any]],
    key: str | None,
) -> None:
    """Keep the response for previous_response_id, GET and input_items; a failure only costs those."""
    doc = {
        "tenant": tenant,
        "response": response,
        "key": key,
        "input": translate.input_items(req.input),
        "messages": history + translate.input_messages(response["output"], where="output"),
    }
    try:
        await svc.store.documents.put(
            _doc_key(tenant, response["id"]), json.dumps(doc, ensure_ascii=False), svc.settings.response_ttl_s
        )
    except StoreError:
        log.warning("responses.not_stored id=%s", response["id"])


def _turnkv_headers(resp: Response, turn: Turn) -> dict[str, str]:
    h = {k: v for k, v in resp.headers.items() if k.startswith("x-")}
    h["x-turnkv-conversation"] = turn.conversation.source if turn.conversation else "none"
    return h


async def create(request: Request) -> Response:
    received = await receive(request)
    svc, raw, tenant = received.svc, received.body, received.who.tenant
    req = models.parse(raw)
    previous = await _previous(svc, tenant, req.previous_response_id) if req.previous_response_id else None
    history = list(previous["messages"]) if previous else []
    history += translate.input_messages(req.input)
    body = translate.chat_body(req, raw, history)
    turn = prepare_turn(
        received, body, messages=body["messages"], response_key=previous.get("key") if previous else None
    )
    resp_id = translate.new_id("resp")
    answer = await run_turn(svc, turn)
    key = turn.conversation.store_key if turn.conversation else None
    if not isinstance(answer, StreamingResponse):
        return await _whole(svc, req, turn, answer, resp_id, tenant, history, key)
    stream = events.EventStream(resp_id, req)
    answer.body_iterator = _translated(svc, req, answer.body_iterator, stream, tenant, history, key)
    return conversation_header(turn, answer)


async def _whole(
    svc: Services,
    req: models.ResponsesBody,
    turn: Turn,
    answer: Response,
    resp_id: str,
    tenant: str,
    history: list[dict[str, Any]],
    key: str | None,
) -> Response:
    chat = json.loads(bytes(answer.body))
    choice = (chat.get("choices") or [{}])[0]
    finish = choice.get("finish_reason")
    output = translate.output_items(choice.get("message") or {}, finish)
    status = "incomplete" if finish == "length" else "completed"
    r = translate.response_object(
        resp_id,
        req,
        output=output,
        status=status,
        created_at=chat.get("created") or 0,
        usage=translate.usage(chat.get("usage")),
        model=chat.get("model"),
    )
    if req.store is not False:
        await _store(svc, req, tenant, r, history, key)
    return JSONResponse(r, headers=_turnkv_headers(answer, turn))


def _translated(
    svc: Services,
    req: models.ResponsesBody,
    chat: Any,
    stream: events.EventStream,
    tenant: str,
    history: list[dict[str, Any]],
    key: str | None,
) -> AsyncIterator[bytes]:
    """The relayed chat stream as Responses events; the response is stored before it completes."""

    async def finish() -> list[Event]:
        if stream.done:
            return []
        last, r = stream.finish()
        if req.store is not False:
            await _store(svc, req, tenant, r, history, key)
        return last

    return reframed(chat, stream.start, stream.chunk, finish)


async def _stored(request: Request) -> tuple[Services, str, dict[str, Any]]:
    """The stored response the path names (tenant-scoped: another tenant's id is not found), with its key."""
    svc = services(request)
    resp_id = request.path_params["response_id"]
    key = _doc_key(principal(request).tenant, resp_id)
    try:
        raw = await svc.store.documents.get(key)
    except StoreError as exc:
        raise StoreUnavailable("the response store is unavailable") from exc
    doc = json.loads(raw) if raw else None
    if not isinstance(doc, dict) or doc.get("tenant") != principal(request).tenant:
        raise ResponseNotFound(f"Response with id '{shown(resp_id)}' not found.", param="response_id")
    return svc, key, doc


async def retrieve(request: Request) -> Response:
    """``GET /v1/responses/{id}``: the Response object as it was created."""
    _, _, doc = await _stored(request)
    return JSONResponse(doc["response"])


async def delete(request: Request) -> Response:
    """``DELETE /v1/responses/{id}``: the response is forgotten; ``previous_response_id`` naming it is then a
    404. The conversation's record (D's KV) is left to its own TTL: identical conversations may share it."""
    svc, key, doc = await _stored(request)
    try:
        await svc.store.documents.delete(key)
    except StoreError as exc:
        raise StoreUnavailable("the response store is unavailable: the response was not deleted") from exc
    return JSONResponse({"id": doc["response"]["id"], "object": "response", "deleted": True})


async def cancel(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``: only a background response can be cancelled, and turnkv runs none
    (``background`` is refused): every stored response is complete. A 400 that says so (a 404 for none)."""
    _, _, doc = await _stored(request)
    raise ClientError(
        f"Response '{shown(doc['response']['id'])}' cannot be cancelled: only responses created with "
        "background=true can be, and turnkv does not run background responses (this one is complete)",
        param="response_id",
    )


async def input_items(request: Request) -> Response:
    """``GET /v1/responses/{id}/input_items``: the items the request that created it sent as ``input`` (not
    those of the responses before it), paged as OpenAI pages lists (``limit``, ``order``, ``after``)."""
    _, _, doc = await _stored(request)
    items = doc.get("input")
    if not isinstance(items, list):  # kept by a gateway that did not keep its input items
        items = []
    return JSONResponse(translate.item_page(items, request.query_params))
