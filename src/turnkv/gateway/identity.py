"""Who a turn belongs to: its tenant, and the conversation it continues, named or found.

Where the conversation comes from, first found wins (``Conversation.source`` says which):

1. ``header``: the configured headers (``X-Session-ID`` first);
2. ``body``: the body's ``session_id`` (vLLM's convention) or ``conversation_id`` (vLLM's multi-turn proxy);
3. ``response``: a Responses API ``previous_response_id``, mapped by the caller to the store key the
   previous response's record went to;
4. ``prompt_cache_key``: OpenAI's field, which clients set per conversation (Codex, some SDKs);
5. ``metadata``: ``metadata.conversation_id`` or ``metadata.session_id``;
6. ``digest``: none of these: the conversation is found from the messages themselves.

The digest: every request's record is stored under a digest of the request's messages, and a
request is looked up under the digest of its messages before the last assistant message, which is
the request that produced that answer when the client continues it. Clients re-send their own
messages as they sent them, but re-create the answer (they drop its reasoning, re-serialize tool
arguments, and some, like smolagents, turn tool calls into text), so the answer itself is left out
of the key; the token check (``reuse/assess.py``) judges it, and the rest, as for any conversation:
a wrong guess costs a recompute, never a wrong answer. Messages are normalized for how frameworks
echo history: role, text (a string, or text parts joined), tool calls as (name, canonical JSON
arguments) and a tool message's text; reasoning, tool-call ids, names and surrounding whitespace do
not count. Two clients continuing the same history (a fork) look up the same key: the claim is
single use, so one reuses and the other recomputes; each stores its record under its own request.

Such keys name what several conversations may share word for word (the same task started three times
at once), so their records live in pools (``state.base.pool``): each conversation stores its record
beside the others', and a claim takes the one holding the answer the client sent back (``prefer``). A
request that was answered before (a retry, a regenerated answer) finds that answer's record under its
own digest: the turn's claim looks there when its history's key holds nothing (``turn.claim``).

The tenant is the request's authenticated one (``auth.Authenticator``). Every store key hashes the
tenant, so one tenant can neither read nor consume another's handle, whatever ids or histories they send.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from turnkv import jsonwire
from turnkv.errors import ClientError
from turnkv.openai.answer import echoed_answer, last_assistant, tool_arguments

_ID = re.compile(r"[A-Za-z0-9._:@/+=\-]+\Z")  # \Z, not $: "id\n" is not "id" (used with match)
BODY_FIELDS = ("session_id", "conversation_id")
METADATA_FIELDS = ("conversation_id", "session_id")
Source = Literal["header", "body", "response", "prompt_cache_key", "metadata", "digest"]


@dataclass(frozen=True)
class Conversation:
    tenant: str  # a hash, never the key itself
    session: str  # the id as the client gave it; for a digest, the looked-up digest
    key: str  # the store key this turn claims: hash of tenant and session, or the digest
    source: Source = "header"
    # where this turn's record is stored when not under ``key``: a conversation found from its history
    # (or a previous response) is stored under the digest of this request's messages
    next_key: str | None = None
    # the digest of the answer the client sent back (``answer.echoed_answer``): of a pool's records, the one
    # holding that answer is this conversation's own
    prefer: str | None = None
    continues: bool = True  # the history holds an earlier answer: ``key`` can name a stored record

    @property
    def log_id(self) -> str:
        return self.key[:12]

    @property
    def store_key(self) -> str:
        """The key capture stores this turn's record under."""
        return self.next_key or self.key

    @property
    def pooled(self) -> bool:
        """Its records live in pools (``state.base.pool``): a history or a previous response names what
        several conversations may share word for word (the same task started twice), an id only one."""
        return self.source in ("digest", "response")


def _hash(*parts: str) -> str:
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).hexdigest()


def _named(
    headers: Mapping[str, str], body: Mapping[str, Any], session_headers: Sequence[str], max_length: int
) -> tuple[str, Source] | None:
    """An id the client chose (header, then body), checked: a bad one is a 400."""
    session: Any = None
    where = ""
    source: Source = "header"
    for h in session_headers:
        if headers.get(h):
            session, where = headers[h], h
            break
    if session is None:
        for f in BODY_FIELDS:
            if body.get(f) is not None:
                session, where, source = body[f], f, "body"
                break
    if session is None:
        return None
    if not isinstance(session, str) or not session:
        raise ClientError(f"{where} must be a non-empty string", param=where)
    if len(session) > max_length or not _ID.match(session):
        raise ClientError(
            f"{where} must be at most {max_length} characters of letters, digits and ._:@/+=-", param=where
        )
    return session, source


def _openai_id(body: Mapping[str, Any]) -> tuple[str, Source] | None:
    """``prompt_cache_key``, then ``metadata.conversation_id`` / ``session_id``: OpenAI fields whose
    values OpenAI accepts freely, so any string is taken (it is hashed); a wrong type is a 400."""
    key = body.get("prompt_cache_key")
    if key is not None:
        if not isinstance(key, str):
            raise ClientError("prompt_cache_key must be a string", param="prompt_cache_key")
        if key:
            return key, "prompt_cache_key"
    meta = body.get("metadata")
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise ClientError("metadata must be an object of strings", param="metadata")
    for f in METADATA_FIELDS:
        value = meta.get(f)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ClientError(f"metadata.{f} must be a string", param=f"metadata.{f}")
        if value:
            return value, "metadata"
    return None


def conversation_of(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    *,
    session_headers: Sequence[str],
    tenant: str,
    max_length: int,
    messages: Sequence[Any] | None = None,
    response_key: str | None = None,
    from_history: bool = True,
) -> Conversation | None:
    """The turn's conversation (precedence in the module docstring), or None for a stateless request.

    ``messages``: the chat messages (default: the body's); ``response_key``: the store key of the
    previous response's record (Responses API); ``from_history``: find a conversation without an id
    from its messages. Bad ids are a 400."""
    if messages is None:
        given = body.get("messages")
        messages = given if isinstance(given, list) else None
    named = _named(headers, body, session_headers, max_length)
    if named is not None:
        return Conversation(tenant, named[0], _hash(tenant, named[0]), named[1])
    if response_key is not None:
        store = history_keys(tenant, messages)[1] if messages else None
        return Conversation(tenant, response_key, response_key, "response", store, _prefer(messages))
    other = _openai_id(body)
    if other is not None:
        return Conversation(tenant, other[0], _hash(tenant, other[0]), other[1])
    if not from_history or not messages:
        return None
    claim, store = history_keys(tenant, messages)
    continues = last_assistant(messages) is not None
    return Conversation(tenant, claim, claim, "digest", store, _prefer(messages), continues)


def _prefer(messages: Sequence[Any] | None) -> str | None:
    echoed = echoed_answer(messages) if messages else None
    return echoed.answer_digest if echoed is not None else None


def _text(content: Any) -> Any:
    """A message's text: a string, or its text parts joined; other parts count whole."""
    if isinstance(content, str):
        return content.strip()
    if content is None:
        return ""
    if isinstance(content, list):
        out: list[Any] = []
        for part in content:
            if (
                isinstance(part, Mapping)
                and isinstance(part.get("text"), str)
                and part.get("type") in ("text", "input_text", "output_text")
            ):
                out.append(part["text"])
            else:
                out.append(part)  # an image or file: the part itself
        if all(isinstance(x, str) for x in out):
            return "\n".join(out).strip()
        return out
    return content


def _calls(message: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for c in message.get("tool_calls") or ():
        fn = c.get("function") if isinstance(c, Mapping) else None
        if isinstance(fn, Mapping):
            out.append([fn.get("name"), tool_arguments(fn.get("arguments"))])
    return out


def _json(value: Any) -> bytes:
    return jsonwire.dumps_sorted(value)


def _normalized(message: Any) -> bytes:
    """What of a message counts for finding its conversation, length-prefixed (a plain-text message,
    the bulk of a history, is hashed as its text: no JSON encoding)."""
    if not isinstance(message, Mapping):
        b = b"\x01" + _json(message)
    else:
        role = message.get("role")
        text = _text(message.get("content"))
        b = (role if isinstance(role, str) else "").encode() + b"\x00"
        b += text.encode() if isinstance(text, str) else b"\x01" + _json(text)
        calls = _calls(message)
        if calls:
            b += b"\x00" + _json(calls)
    return len(b).to_bytes(8, "little") + b


def history_keys(tenant: str, messages: Sequence[Any]) -> tuple[str, str]:
    """(the key to claim, the key to store under) for a conversation found from its messages: the
    digest of the messages before the last assistant message (the request that answer was for), and
    the digest of all of them (this request), in one pass. With no assistant message the claim is the
    digest of no messages, which no request is stored under."""
    h = hashlib.blake2b(digest_size=16, person=b"turnkv-history")
    h.update(tenant.encode() + b"\x00")
    last = last_assistant(messages)
    claim = h.hexdigest() if last is None else ""
    for i, m in enumerate(messages):
        if i == last:
            claim = h.hexdigest()
        h.update(_normalized(m))
    return claim, h.hexdigest()
