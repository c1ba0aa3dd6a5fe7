"""The one way in: how every front end's request becomes a ``Turn`` (chat completions, completions, the
Responses API, and any next one).

``receive`` takes a turn request off the wire: refused while the gateway drains, its body read within the
limits (``body.read_json``), checked against the engine family's own rules (``Engine.check_request``) and
the served models. The front end then reads its own shape and, where it is not chat completions itself,
translates it into a chat (or completions) body. ``prepare_turn`` checks that body (what of it may reach
the engines: ``fields``; field types, output length), finds the conversation (``identity.conversation_of``),
sets the tenant's prefix-cache salt and builds the turn, which ``turn.driver.run_turn`` runs. All of it
happens before the conversation's record is claimed, so bad input is a 4xx in OpenAI's shape and costs
nothing.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from turnkv.errors import ShuttingDown
from turnkv.gateway.auth import Principal, cache_salt
from turnkv.gateway.body import ChatBody, CompletionBody, check_model, check_output_length, read_json, validate
from turnkv.gateway.fields import engine_body, engine_fields
from turnkv.gateway.identity import conversation_of
from turnkv.gateway.services import Services
from turnkv.gateway.turn.request import Turn

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def services(request: Request) -> Services:
    svc: Services = request.state.services
    return svc


def principal(request: Request) -> Principal:
    """Who sent the request (``edge.EdgeMiddleware`` authenticated it and left this in its state)."""
    who: Principal = request.state.principal
    return who


def request_id(request: Request) -> str:
    """The client's ``X-Request-Id`` when it is a plain token, else a new one."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


async def read_body(svc: Services, request: Request) -> dict[str, Any]:
    """The request's JSON object, read within the size, time and depth limits."""
    s = svc.settings
    return await read_json(
        request, s.max_body_bytes, timeout_s=s.limits.body_timeout_s, max_depth=s.limits.max_json_depth
    )


@dataclass(frozen=True)
class Received:
    """A turn request as it arrived: who sent it, under which id, and its JSON as sent."""

    svc: Services
    request: Request
    who: Principal
    request_id: str
    body: dict[str, Any]


async def receive(request: Request) -> Received:
    """A turn request off the wire, refused when the gateway drains, when the engine family does not let a
    client send what it holds, or when it names a model the gateway does not serve."""
    svc = services(request)
    if svc.drain.refusing:
        raise ShuttingDown("the gateway is shutting down; send the turn again")
    body = await read_body(svc, request)
    svc.engine.check_request(body)
    model = body.get("model")
    if isinstance(model, str):  # other types are the front end's validation to refuse
        check_model(model, svc.models)
    return Received(svc, request, principal(request), request_id(request), body)


def prepare_turn(
    received: Received,
    body: Mapping[str, Any] | None = None,
    *,
    completions: bool = False,
    messages: Sequence[Any] | None = None,
    response_key: str | None = None,
) -> Turn:
    """The turn for ``body``: a chat completions request (a completions one when ``completions``), the
    client's own body unless the front end translated it. The conversation is found from the client's body
    and headers, with ``messages`` (default: the body's) and ``response_key`` (the store key a previous
    response named) as ``identity.conversation_of`` takes them."""
    svc, s = received.svc, received.svc.settings
    body = received.body if body is None else body
    clean = engine_body(body, chat=not completions, allowed=engine_fields(s))  # what may reach the engines
    parsed: ChatBody | CompletionBody = (
        validate(dict(body), CompletionBody) if completions else validate(dict(body), ChatBody)
    )
    model = body.get("model") or next(iter(svc.models), None)
    check_output_length(body, svc.catalog.model_len.get(model) if isinstance(model, str) else None)
    conversation = (
        None
        if completions
        else conversation_of(
            received.request.headers,
            received.body,
            session_headers=s.session_headers,
            tenant=received.who.tenant,
            max_length=s.max_session_id_length,
            messages=messages,
            response_key=response_key,
            from_history=s.conversation_from_history,
        )
    )
    clean["cache_salt"] = cache_salt(received.who.tenant, received.body.get("cache_salt"))
    return Turn.of(
        request_id=received.request_id,
        body=clean,
        parsed=parsed,
        authorization=received.who.forward_authorization,
        conversation=conversation,
    )


def conversation_header(turn: Turn, response: Response) -> Response:
    """Where the turn's conversation came from (``identity``), for clients that want to see it."""
    response.headers["x-turnkv-conversation"] = turn.conversation.source if turn.conversation else "none"
    return response
