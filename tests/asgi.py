"""An ASGI request scope for tests that drive the gateway's app directly (to control when the body
arrives and when the client leaves, which an HTTP client cannot)."""

from __future__ import annotations

from typing import Any


def chat_scope(
    headers: dict[str, str], *, state: dict[str, Any] | None = None, path: str = "/v1/chat/completions"
) -> dict[str, Any]:
    """A POST to ``path`` (the chat route unless given) with a JSON body and ``headers`` (lower-case names)."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
        "headers": [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in headers.items())],
    }
    if state is not None:
        scope["state"] = state.copy()
    return scope
