"""orjson on the hot path: the bytes and digests it gives are the stdlib's on what turnkv carries, and
what orjson reads or writes differently (big integers, NaN, lone surrogates) keeps the stdlib's result
or a clear 400."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from turnkv import jsonwire
from turnkv.errors import ClientError
from turnkv.gateway.body import read_json
from turnkv.gateway.turn.direct import history_digest

DOCS: list[Any] = [
    {"model": "m", "messages": [{"role": "user", "content": 'héllo \u2028 \x00\x1f "q" \\ / 😀 é'}]},
    {"z": 1, "a": [1, 2.5, -3, None, True, False, "x"], "m": {"b": {}, "a": []}, 3: "int key"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "n": 1 << 62},
    [0.1, 1.0, 123456789.0, -0.0, 1e16],
]


@pytest.mark.parametrize("doc", DOCS)
def test_bytes_match_the_stdlib(doc: Any) -> None:
    assert jsonwire.dumps(doc) == json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    if not (isinstance(doc, dict) and 3 in doc):  # the stdlib cannot sort mixed key types at all
        std_sorted = json.dumps(doc, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)
        assert jsonwire.dumps_sorted(doc) == std_sorted.encode()


def test_history_digest_is_the_one_stored_records_hold() -> None:
    body = {"model": "m", "tools": [{"type": "function", "function": {"name": "f"}}], "chat_template_kwargs": {}}
    msgs = [{"role": "user", "content": "é"}, {"role": "assistant", "content": None, "tool_calls": []}]
    doc = {"messages": msgs, **body}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    assert history_digest(body, msgs) == hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()


def test_what_orjson_cannot_encode_falls_back() -> None:
    big = {"n": 1 << 70, "s": "é"}
    assert jsonwire.dumps(big) == b'{"n":1180591620717411303424,"s":"\xc3\xa9"}'
    assert jsonwire.dumps_sorted(big) == b'{"n":1180591620717411303424,"s":"\xc3\xa9"}'
    assert jsonwire.loads_lenient(b'{"x": NaN}')["x"] != 0  # the stdlib reads what an engine may send


async def _echo(request: Request) -> JSONResponse:
    try:
        body = await read_json(request, 1 << 20, max_depth=8)
    except ClientError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    return JSONResponse({"repr": repr(body)})


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        (b'{"seed": 123456789012345678901234567890}', "{'seed': 123456789012345678901234567890}"),
        (b'{"a": [1.5, 9007199254740993]}', "{'a': [1.5, 9007199254740993]}"),
        (b'{"a": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"a": "\xed\xa0\x80"}', "lone UTF-16 surrogate"),
        (b'{"n": 123456789012345678901234567890, "a": "\\udfff"}', "lone UTF-16 surrogate"),
        (b"[" * 2000 + b"]" * 2000, "nested more than 8 levels"),
        (b'{"a": ' + b"[" * 20 + b"]" * 20 + b"}", "nested more than 8 levels"),
        (b'{"a": NaN}', "not valid JSON"),
        (b"{", "not valid JSON"),
    ],
)
def test_read_json(raw: bytes, expect: str) -> None:
    client = TestClient(Starlette(routes=[Route("/", _echo, methods=["POST"])]))
    r = client.post("/", content=raw)
    got = r.json()
    if expect.startswith("{"):
        assert r.status_code == 200 and got["repr"] == expect
    else:
        assert r.status_code == 400 and expect in got["error"]
