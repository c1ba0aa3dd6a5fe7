"""SALT: the cache salt of a pull sent to P ahead of the token check (``turn.ahead`` says why it is needed)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any


def salted(body: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """The request as P gets it for a pull ahead of the check: with a cache salt of this turn's own (the
    client's salt folded in), so the blocks it pulls are cached where no other request looks."""
    own = body.get("cache_salt")
    salt = hashlib.blake2b(f"{own!r}|{request_id}".encode(), digest_size=12).hexdigest()
    return {**body, "cache_salt": f"turnkv-ahead-{salt}"}
