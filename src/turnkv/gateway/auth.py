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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from turnkv.errors import ClientError, Forbidden, Unauthorized

if TYPE_CHECKING:
    from turnkv.config import Settings

ANONYMOUS = "anonymous"
_DIGEST = re.compile(r"[0-9a-f]{64}")
_TENANT_NAME = re.compile(r"[A-Za-z0-9._:@/+=\-]{1,128}")
_BEARER = re.compile(r"bearer[ \t]+(\S+)[ \t]*", re.IGNORECASE)


class KeyFileError(ValueError):
    """A key file or key list line that cannot be read; raised at start (a ``ConfigError`` there)."""


@dataclass(frozen=True)
class Principal:
    tenant: str  # a hash (t:..., k:...) or "anonymous"
    name: str | None  # the tenant's configured name, for admin checks; None when it has none
    authenticated: bool  # by a key or the trusted proxy
    admin: bool  # may read /metrics and /ready's details
    forward_authorization: str | None  # the client's Authorization, when the engines may see it


def _hash(*parts: str) -> str:
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).hexdigest()


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def named_tenant(name: str) -> str:
    """The tenant id of a configured name: the same whether a key or the trusted proxy names it."""
    return "t:" + _hash("tenant", name)[:16]


def bearer_token(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive), else None."""
    if not value:
        return None
    m = _BEARER.fullmatch(value.strip())
    return m.group(1) if m else None


def parse_key_line(line: str) -> tuple[str, str] | None:
    """``(sha256 digest, tenant name)`` of one key line; None for blanks and ``#`` comments.

    ``sha256:<64 hex> [tenant]`` gives the digest; any other first word is a plain key, hashed here. A key
    without a tenant is its own tenant, named after its digest."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    parts = text.split()
    if len(parts) > 2:
        raise KeyFileError("a key line is '<key or sha256:hex> [tenant]'")
    key = parts[0]
    if key.lower().startswith("sha256:"):
        digest = key[len("sha256:") :].lower()
        if not _DIGEST.fullmatch(digest):
            raise KeyFileError("sha256: must be followed by 64 hex digits")
    else:
        digest = key_digest(key)
    name = parts[1] if len(parts) == 2 else "key-" + digest[:16]
    if not _TENANT_NAME.fullmatch(name):
        raise KeyFileError("a tenant name is 1-128 characters of letters, digits and ._:@/+=-")
    return digest, name


def parse_keys(lines: Iterable[str], source: str) -> dict[str, str]:
    """digest -> tenant name; a key listed twice for two tenants is refused."""
    keys: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        try:
            parsed = parse_key_line(line)
        except KeyFileError as exc:
            raise KeyFileError(f"{source} line {n}: {exc}") from None  # the line may hold a key: not echoed
        if parsed is None:
            continue
        digest, name = parsed
        if keys.get(digest, name) != name:
            raise KeyFileError(f"{source} line {n}: this key is already listed for another tenant")
        keys[digest] = name
    return keys


def load_keys(settings: Settings) -> dict[str, str]:
    """Every configured key (the file's and ``api_keys``), as digests; read at start."""
    keys = parse_keys((k.get_secret_value() for k in settings.api_keys), "api_keys")
    if settings.api_keys_file:
        path = Path(settings.api_keys_file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise KeyFileError(f"api_keys_file {path}: {exc.strerror or exc}") from None
        for digest, name in parse_keys(text.splitlines(), f"api_keys_file {path}").items():
            if keys.get(digest, name) != name:
                raise KeyFileError(f"api_keys_file {path}: a key is listed for two tenants")
            keys[digest] = name
    if (settings.api_keys or settings.api_keys_file) and not keys:
        raise KeyFileError("API keys are configured, but none was found")
    return keys


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
                if not _TENANT_NAME.fullmatch(name):
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
