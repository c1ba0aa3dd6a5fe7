"""The gateway's API keys as configured (``api_keys``, ``api_keys_file``): key lines read into SHA-256 digests
and tenant names, at start (``Settings`` refuses a malformed file; ``gateway.auth`` checks requests against
the digests). A key itself is never kept.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from turnkv.config import Settings

_DIGEST = re.compile(r"[0-9a-f]{64}")
TENANT_NAME = re.compile(r"[A-Za-z0-9._:@/+=\-]{1,128}")  # a tenant's configured name


class KeyFileError(ValueError):
    """A key file or key list line that cannot be read; raised at start (a ``ConfigError`` there)."""


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


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
    if not TENANT_NAME.fullmatch(name):
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
