"""Who a turn belongs to: its tenant, and the conversation it continues (if it names one).

The conversation id comes from the configured headers (``X-Session-ID`` first), then the body's
``session_id`` (vLLM's convention) or ``conversation_id`` (vLLM's multi-turn proxy). The tenant is
the request's authenticated one (``auth.Authenticator``). The store key hashes both, so one tenant can
neither read nor consume another's handle, whatever ids they choose.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnkv.errors import ClientError

_ID = re.compile(r"[A-Za-z0-9._:@/+=\-]+\Z")  # \Z, not $: "id\n" is not "id" (used with match)
BODY_FIELDS = ("session_id", "conversation_id")


@dataclass(frozen=True)
class Conversation:
    tenant: str  # a hash, never the key itself
    session: str
    key: str  # the store key: hash of tenant and session

    @property
    def log_id(self) -> str:
        return self.key[:12]


def _hash(*parts: str) -> str:
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).hexdigest()


def conversation_of(
    headers: Mapping[str, str], body: Mapping[str, Any], *, session_headers: Sequence[str],
    tenant: str, max_length: int,
) -> Conversation | None:
    """The turn's conversation, or None for a stateless request. Bad ids are a 400."""
    session = None
    source = None
    for h in session_headers:
        if headers.get(h):
            session, source = headers[h], h
            break
    if session is None:
        for f in BODY_FIELDS:
            if body.get(f) is not None:
                session, source = body[f], f
                break
    if session is None:
        return None
    if not isinstance(session, str) or not session:
        raise ClientError(f"{source} must be a non-empty string", param=source)
    if len(session) > max_length or not _ID.match(session):
        raise ClientError(
            f"{source} must be at most {max_length} characters of letters, digits and ._:@/+=-", param=source)
    return Conversation(tenant, session, _hash(tenant, session))
