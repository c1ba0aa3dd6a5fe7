"""The SSE rewriting, free of vLLM: give stream chunks the ``kv_transfer_params`` key of vLLM 0.33's chat streams.

vLLM 0.33 (``chat_completion/serving.py``, ``completion/serving.py``) sets ``kv_transfer_params`` on
every chunk that carries generated output: ``null`` on token chunks, the engine's dict on the chunk
whose choice has a ``finish_reason``. Chunks that carry no generated output lack the key: the chat
role chunk (and ``echo`` chunk), and the trailing usage chunk (dumped with ``exclude_none``). The
field is the stream class's last, so it is the last key of the chunk's JSON.

A 0.26 chat chunk carries generated output exactly when a choice has the key ``token_ids`` (set
explicitly, even to ``null``, on token and finish chunks; never on the role or echo chunk). Every
completions chunk with choices carries output.

The chunk's bytes are kept as vLLM wrote them: the key is inserted before the closing brace, not by
re-serialising the chunk, so floats, key order and non-ASCII text are untouched.
"""

from __future__ import annotations

import json
from typing import Any, Literal

Kind = Literal["chat", "completion", "generate"]
FIELD = "kv_transfer_params"
_PREFIX = "data: "
_SUFFIX = "\n\n"

try:  # pydantic-core writes the dict exactly as vLLM 0.33's model_dump_json would
    from pydantic_core import to_json as _pyd_to_json
except ImportError:  # pragma: no cover - vLLM always has pydantic
    _pyd_to_json = None


def dumps_params(params: dict[str, Any] | None) -> str:
    """Compact JSON for the params, as pydantic writes a ``dict[str, Any]`` field."""
    if _pyd_to_json is not None:
        try:
            return _pyd_to_json(params).decode()
        except Exception:
            pass
    return json.dumps(params, ensure_ascii=False, separators=(",", ":"), default=str)


def carries_output(chunk: dict[str, Any], kind: Kind) -> bool:
    """Whether vLLM 0.33 would set ``kv_transfer_params`` on this chunk."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False  # usage chunk, error, or anything else without choices
    if kind != "chat":
        return True
    return any(isinstance(c, dict) and "token_ids" in c for c in choices)


def is_final(chunk: dict[str, Any]) -> bool:
    return any(isinstance(c, dict) and c.get("finish_reason") is not None for c in chunk.get("choices") or [])


def rewrite_event(event: str, kind: Kind, params: dict[str, Any] | None) -> str:
    """One SSE event (``data: <json>\\n\\n``) as vLLM 0.33 would have written it.

    ``params`` is the ``kv_transfer_params`` of the engine output this chunk came from; it is put
    on the chunk only when the chunk finishes a choice, as 0.33 does. Events that are not a chunk
    object, that lack generated output, or that already have the key are returned unchanged.
    """
    if not (event.startswith(_PREFIX) and event.endswith(_SUFFIX)):
        return event
    payload = event[len(_PREFIX) : -len(_SUFFIX)]
    if not payload.startswith("{") or not payload.endswith("}"):
        return event  # [DONE], or not an object
    try:
        chunk = json.loads(payload)
    except ValueError:
        return event
    if not isinstance(chunk, dict) or FIELD in chunk or not carries_output(chunk, kind):
        return event
    value = params if is_final(chunk) else None
    sep = "" if payload == "{}" else ","
    return f'{_PREFIX}{payload[:-1]}{sep}"{FIELD}":{dumps_params(value)}}}{_SUFFIX}'
