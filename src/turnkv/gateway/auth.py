"""Who a request comes from: its tenant, whether it may see operator data, and what the engines see of it.

Decides, per request, from the headers alone:

* with gateway API keys configured (``api_keys``, ``api_keys_file``), a request needs
  ``Authorization: Bearer <key>`` (the scheme in any case; on Anthropic's API also ``x-api-key: <key>``, as
  its SDKs send it) naming a known key; its tenant is the key's
  (each key its own tenant unless the file maps it). Keys are held as SHA-256 digests only.
* a trusted proxy (``trusted_proxy_secret``) proves itself with that secret in ``trusted_proxy_header``;
  only then is ``tenant_header`` read. A client's own tenant header is never believed.
* with neither, everyone is served; the tenant is a hash of the bearer token (so clients that hold
  different secrets stay apart), else ``anonymous``.

A tenant id is a hash (``t:``, ``k:``), never a key. The prefix-cache salt sent to the engines is
derived from it, so one tenant cannot probe another's cached prompts.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from turnkv.api_keys import TENANT_NAME, key_digest, load_keys
from turnkv.errors import ClientError, Forbidden, Unauthorized

if TYPE_CHECKING:
    from turnkv.config import Settings

ANONYMOUS = "anonymous"
_BEARER = re.compile(r"bearer[ \t]+(\S+)[ \t]*", re.IGNORECASE)


@dataclass(frozen=True)
class Principal:
    tenant: str  # a hash (t:..., k:...) or "anonymous"
    name: str | None  # the tenant's configured name, for admin checks; None when it has none
    authenticated: bool  # by a key or the trusted proxy
    admin: bool  # may read /metrics and /ready's details
    forward_authorization: str | None  # the client's Authorization, when the engines may see it


def _hash(*parts: str) -> str:
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).hexdigest()


def named_tenant(name: str) -> str:
    """The tenant id of a configured name: the same whether a key or the trusted proxy names it."""
    return "t:" + _hash("tenant", name)[:16]


def bearer_token(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive), else None."""
    if not value:
        return None
    m = _BEARER.fullmatch(value.strip())
    return m.group(1) if m else None


def cache_salt(tenant: str, client_salt: str | None) -> str:
    """The engines' prefix-cache salt for a tenant: its cached prompts match only its own requests."""
    return "turnkv-" + _hash("cache_salt", tenant, client_salt or "")


class Authenticator:
    """Built once per app from the settings; answers one request's ``Principal`` or raises a 401."""

    def __init__(self, settings: Settings) -> None:
        self._keys = load_keys(settings)
        secret = settings.trusted_proxy_secret
        self._proxy_secret = secret.get_secret_value().encode() if secret else None
        self._proxy_header = settings.trusted_proxy_header
        self._tenant_header = settings.tenant_header
        self._admins = frozenset(settings.admin_tenants)
        self.required = bool(self._keys) or self._proxy_secret is not None

    def _from_proxy(self, headers: Mapping[str, str]) -> bool:
        if self._proxy_secret is None:
            return False
        given = headers.get(self._proxy_header)
        return given is not None and hmac.compare_digest(given.encode(), self._proxy_secret)

    def _named(self, name: str) -> Principal:
        return Principal(named_tenant(name), name, True, name in self._admins, None)

    def authenticate(self, headers: Mapping[str, str], *, x_api_key: bool = False) -> Principal:
        """``x_api_key``: the API takes the key in ``x-api-key`` too (Anthropic's, whose SDKs send it so)."""
        auth = headers.get("authorization")
        token = bearer_token(auth)
        if x_api_key and not auth and headers.get("x-api-key"):
            token = headers["x-api-key"].strip() or None  # the same key, read as a bearer token would be
            auth = f"Bearer {token}" if token else None
        if self._from_proxy(headers):
            name = headers.get(self._tenant_header) if self._tenant_header else None
            if name:
                if not TENANT_NAME.fullmatch(name):
                    raise ClientError(
                        f"{self._tenant_header} must be 1-128 characters of letters, digits and ._:@/+=-",
                        param=self._tenant_header,
                    )
                return self._named(name)
            if token is None or not self._keys:
                return Principal(ANONYMOUS, None, True, False, None)
        if self._keys:
            if token is None:
                how = "'Authorization: Bearer <key>'" + (" or 'x-api-key: <key>'" if x_api_key else "")
                raise Unauthorized(f"You didn't provide an API key: send it as {how}.")
            name = self._keys.get(key_digest(token))
            if name is None:
                raise Unauthorized("Incorrect API key provided.")
            return self._named(name)
        if self.required:
            raise Unauthorized("This gateway serves requests through its trusted proxy only.")
        secret = token if token is not None else (auth or "").strip()  # another scheme: its whole credential
        tenant = "k:" + _hash("key", secret)[:16] if secret else ANONYMOUS
        return Principal(tenant, None, False, True, auth)

    def anonymous(self) -> Principal:
        """For the routes anyone may call (/health, /ready): what they see without credentials."""
        return Principal(ANONYMOUS, None, False, not self.required, None)


def require_admin(principal: Principal) -> None:
    if not principal.admin:
        raise Forbidden("This needs an operator's API key (a tenant in admin_tenants).")
