"""How turnkv reads and writes JSON on the hot path (request bodies, engine calls, SSE chunks, records,
digests): with orjson, which parses and encodes our payloads several times faster than the stdlib.

``dumps`` gives the bytes ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))`` gives, in the
same key order, except for floats in exponent form (orjson writes 1e-05 as 0.00001) and NaN/Infinity
(null): where a client sees re-encoded bytes (openai/sse.py, engine/vllm/stream.py) the stdlib stays.
What orjson cannot encode (integers past 64 bits, which only the stdlib parser makes) falls back to the
stdlib with the same options, so nothing that encoded before fails now.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

JSONDecodeError = orjson.JSONDecodeError  # a ValueError, as json.JSONDecodeError
_PLAIN = orjson.OPT_NON_STR_KEYS
_SORTED = orjson.OPT_NON_STR_KEYS | orjson.OPT_SORT_KEYS


def loads(raw: bytes | bytearray | str) -> Any:
    """Parse strict JSON: no NaN/Infinity, no lone surrogates, no BOM; integers past 64 bits come back as
    floats (``gateway/body.py`` re-reads such a body with the stdlib)."""
    return orjson.loads(raw)


def loads_lenient(raw: bytes | bytearray | str) -> Any:
    """Parse what an engine sent: orjson, and the stdlib for what orjson refuses (NaN, Infinity, a lone
    surrogate) so that a chunk the stdlib read before is still read, capture included."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON, keys in insertion order."""
    try:
        return orjson.dumps(obj, option=_PLAIN)
    except orjson.JSONEncodeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def dumps_sorted(obj: Any) -> bytes:
    """Compact UTF-8 JSON with sorted keys, anything not JSON as its ``str`` (for digests): the bytes
    ``json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)`` gives,
    floats in exponent form aside."""
    try:
        return orjson.dumps(obj, default=str, option=_SORTED)
    except orjson.JSONEncodeError:
        return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str).encode()
