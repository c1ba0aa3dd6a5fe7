"""Reads vLLM's decode answer once, for two readers: the client and the next turn.

For the client it removes what turnkv added to the request (token ids it did not ask for, the KV
handle); for the next turn it collects D's prompt ids, generated ids, the handle (on the final chunk
under vLLM >= 0.33 or with turnkv's plugin, or in the JSON body) and the answer's text. Works on SSE
events (``DecodeCapture.chunk``, read through ``VllmDecodeStream``) and on a non-streamed body alike.
vLLM writes compact JSON, which most of the parsing relies on to avoid a full parse of every chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from turnkv import jsonwire
from turnkv.engine.base import DecodeStream, Handle, Piece, StreamBroken, framed
from turnkv.engine.vllm.http import let_go
from turnkv.openai.answer import AnswerAccumulator
from turnkv.openai.sse import DONE, SSESplitter

_PROMPT_IDS = b'"prompt_token_ids":['
_OUTPUT_MARKS = (b'"content":"', b'"reasoning":"', b'"reasoning_content":"', b'"text":"')


def _relay_as_is(payload: bytes) -> bool:
    """A chunk a stateless turn forwards untouched: no error, no handle, no finish to note."""
    return (
        not payload.startswith(b'{"error"')
        and b'"kv_transfer_params":{' not in payload
        and b'"finish_reason":"' not in payload
    )


def _shows_output(payload: bytes) -> bool:
    """Whether a chunk carries generated text or a tool call (vLLM writes compact JSON)."""
    if b'"tool_calls":[' in payload:
        return True
    for mark in _OUTPUT_MARKS:
        i = payload.find(mark)
        if i >= 0 and payload[i + len(mark) : i + len(mark) + 1] != b'"':
            return True
    return False


def _cut_list(payload: bytes, key: bytes) -> tuple[bytes, bytes | None]:
    """The payload with the first ``key`` list of ints in compact JSON replaced by null, and that list's
    JSON (ids never hold a ']'); (payload, None) when there is none."""
    i = payload.find(key)
    if i < 0:
        return payload, None
    start = i + len(key) - 1
    end = payload.find(b"]", start)
    if end < 0:
        return payload, None
    return payload[:start] + b"null" + payload[end + 1 :], payload[start : end + 1]


def _null_list(payload: bytes, key: bytes) -> bytes:
    return _cut_list(payload, key)[0]


def _empty(choice: dict[str, Any]) -> bool:
    """A choice that says nothing once its token ids are gone: no text, no role, no finish, no logprobs."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") or choice.get("text"):
        return False
    delta = choice.get("delta")
    return not (isinstance(delta, dict) and any(v not in (None, "", []) for v in delta.values()))


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _patch(payload: bytes, key: bytes, old: Any, new: bytes) -> bytes | None:
    """The payload with ``key``'s value (``old``, as vLLM's compact JSON writes it) replaced by ``new``,
    the rest of vLLM's bytes as they came; None when that value is not found exactly once, whole."""
    try:
        was = key + orjson.dumps(old)
    except orjson.JSONEncodeError:
        return None
    i = payload.find(was)
    if i < 0 or payload.find(was, i + 1) >= 0:
        return None
    end = i + len(was)
    if payload[end : end + 1] not in (b",", b"}"):
        return None  # a longer number, or not where the key's value ends
    return payload[:i] + key + new + payload[end:]


class _Edit:
    """One chunk being read: the bytes to forward as they are edited, the parsed object, D's prompt ids as
    vLLM wrote them (cut out of the bytes, parsed later), and whether the bytes could not be edited exactly
    (then the object is re-encoded). A plain class with slots: one is made per chunk."""

    __slots__ = ("cut", "obj", "payload", "prompt_json", "redump")

    def __init__(self, payload: bytes, obj: dict[str, Any], cut: bytes, prompt_json: bytes | None) -> None:
        self.payload = payload
        self.obj = obj
        self.cut = cut  # the payload with its prompt ids nulled (the payload itself when it has none to cut)
        self.prompt_json = prompt_json
        self.redump = False

    def bare(self) -> bool:
        """Nothing at the chunk's top level but its choices (no prompt ids, no usage)."""
        return self.prompt_json is None and "prompt_token_ids" not in self.obj and not self.obj.get("usage")

    def patch(self, key: bytes, old: Any, new: bytes) -> None:
        """``key``'s value replaced in the bytes (``_patch``), or a redump where that cannot be exact."""
        patched = _patch(self.payload, key, old, new)
        self.redump = self.redump or patched is None
        self.payload = patched or self.payload


def _read(payload: bytes) -> _Edit | None:
    """The chunk parsed, its prompt ids left out of the parse when vLLM wrote them at the top level in compact
    JSON; None when it is not a JSON object."""
    cut, prompt_json = _cut_list(payload, _PROMPT_IDS)
    try:
        obj = jsonwire.loads_lenient(cut)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if prompt_json is not None and not (obj.get("prompt_token_ids", 0) is None and payload.count(_PROMPT_IDS) == 1):
        # not the chunk's own top-level list (a completion's choice carries it): parse it all
        obj, prompt_json = jsonwire.loads_lenient(payload), None
    return _Edit(payload, obj, cut, prompt_json)


@dataclass
class DecodeCapture:
    """What the decode leg produced, gathered while it is relayed."""

    keep_token_ids: bool  # the client asked for return_token_ids itself
    collect: bool = True  # gather what the next turn needs; False: only relay (a stateless turn)
    _prompt_ids: list[int] | None = None
    # D's prompt ids as D sent them (a 16k-token prompt is 100 KB of JSON in the first chunk): parsed when
    # the capture needs them, after the answer, rather than before the first token is relayed
    _prompt_ids_json: bytes | None = None
    token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    answer: AnswerAccumulator = field(default_factory=AnswerAccumulator)
    # prompt tokens this turn did not compute (P's cache and pull, as P counted them): what the client's
    # usage.prompt_tokens_details.cached_tokens says instead of D's view (D got them all from P)
    cached_tokens: int | None = None

    @property
    def prompt_token_ids(self) -> list[int] | None:
        if self._prompt_ids_json is not None:
            try:
                ids = jsonwire.loads_lenient(self._prompt_ids_json)
            except ValueError:
                ids = None
            self._prompt_ids = ids if isinstance(ids, list) else None
            self._prompt_ids_json = None
        return self._prompt_ids

    @prompt_token_ids.setter
    def prompt_token_ids(self, ids: list[int] | None) -> None:
        self._prompt_ids, self._prompt_ids_json = ids, None

    @property
    def handle(self) -> Handle | None:
        return self.kv_transfer_params

    def _usage(self, obj: dict[str, Any]) -> tuple[Any, int] | None:
        """Note the usage; (the cached_tokens D said, what this turn says) when corrected (the chunk must
        say it too)."""
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        if self.cached_tokens is None or not isinstance(details, dict) or "cached_tokens" not in details:
            return None
        said = details["cached_tokens"]
        details["cached_tokens"] = min(self.cached_tokens, int(usage.get("prompt_tokens") or 0))
        return said, details["cached_tokens"]

    def as_is(self, data: bytes) -> bool:
        """Whether a read's bytes go to the client unchanged and unsplit: a relay-only capture (a stateless
        turn), the read whole one-line ``data: `` events (as vLLM writes them), none of which ends the answer,
        carries an error, the handle or a count to correct. Each test is a scan of the bytes, not a parse."""
        if self.collect or not data.endswith(b"\n\n") or b"\r" in data:
            return False
        events = data.count(b"\n\n")  # each starts with "data: " and has no other line
        if not data.startswith(b"data: ") or data.count(b"\n\ndata: ") != events - 1 or data.count(b"\n") != 2 * events:
            return False
        return (
            b"[DONE]" not in data
            and b'{"error"' not in data
            and b'"kv_transfer_params":{' not in data
            and b'"finish_reason":"' not in data
            and not (self.cached_tokens is not None and b'"cached_tokens"' in data)
        )

    def chunk(self, payload: bytes) -> tuple[bytes | None, bool]:
        """One SSE payload: the bytes to forward (None: nothing a client of plain vLLM would have got, so
        nothing to forward), and whether it shows the client output (text, a tool call, the finish, or
        token ids the client asked for)."""
        if payload == DONE:
            return payload, False
        if (
            not self.collect
            and _relay_as_is(payload)
            and not (self.cached_tokens is not None and b'"cached_tokens"' in payload)  # a count to correct
        ):
            return payload, _shows_output(payload)
        edit = _read(payload)
        if edit is None:
            return payload, False
        obj = edit.obj
        if "error" in obj and "choices" not in obj:
            self.error = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            return payload, False
        # what must change is changed in vLLM's bytes (the ids nulled, the handle nulled, cached_tokens
        # corrected); only a chunk where that cannot be done exactly is re-encoded from the parsed object
        # (each step only where the chunk holds what it changes: most chunks are a delta and nothing else)
        if edit.prompt_json is not None or "prompt_token_ids" in obj:
            self._take_prompt_ids(edit)
        if obj.get("kv_transfer_params") is not None:
            self._take_handle(edit)
        if self.cached_tokens is not None:
            self._correct_usage(edit)
        visible, ours = self._take_choices(edit)
        if ours is not None and not visible and _empty(ours):  # (only then: most chunks show text)
            return None, False
        if not edit.redump:
            return edit.payload, visible
        if edit.prompt_json is not None and self.keep_token_ids:
            obj["prompt_token_ids"] = self.prompt_token_ids  # the client asked for them
        return _dumps(obj), visible

    def _take_prompt_ids(self, edit: _Edit) -> None:
        """D's prompt ids: kept as their JSON (parsed when needed), hidden unless the client asked."""
        obj = edit.obj
        if edit.prompt_json is not None:
            self._prompt_ids, self._prompt_ids_json = None, edit.prompt_json
            if not self.keep_token_ids:
                edit.payload = edit.cut
        elif isinstance(obj.get("prompt_token_ids"), list):  # not compact JSON: parsed with the rest
            self.prompt_token_ids = obj["prompt_token_ids"]
            if not self.keep_token_ids:
                obj["prompt_token_ids"] = None
                edit.redump = True

    def _take_handle(self, edit: _Edit) -> None:
        """D's handle: kept, and never shown the client."""
        kv = edit.obj["kv_transfer_params"]
        if isinstance(kv, dict):
            self.kv_transfer_params = kv
        edit.obj["kv_transfer_params"] = None
        edit.patch(b'"kv_transfer_params":', kv, b"null")

    def _correct_usage(self, edit: _Edit) -> None:
        fixed = self._usage(edit.obj)
        if fixed is not None:
            said, now = fixed
            edit.patch(b'"cached_tokens":', said, str(now).encode())

    def _take_choices(self, edit: _Edit) -> tuple[bool, dict[str, Any] | None]:
        """Collect the first choice's ids, text and finish; whether the chunk shows output, and the choice
        whose only news were token ids the client did not ask for (None when there is none)."""
        visible = False
        ours: dict[str, Any] | None = None
        hide = not self.keep_token_ids
        for choice in edit.obj.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids += ids
                visible = visible or (bool(ids) and not hide)
                ours = choice if hide and edit.bare() else None
                if hide:
                    choice["token_ids"] = None
                    nulled = _null_list(edit.payload, b'"token_ids":[')
                    edit.redump = edit.redump or nulled is edit.payload  # not compact JSON: only a redump hides
                    edit.payload = nulled
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self.answer.delta(delta)
                get = delta.get
                visible = visible or bool(get("content") or get("reasoning") or get("reasoning_content"))
                visible = visible or bool(get("tool_calls"))
            if choice.get("text"):
                visible = True
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
                visible = True
        return visible, ours

    def body(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming body: collect, and return it as the client should see it."""
        if isinstance(obj.get("prompt_token_ids"), list):
            self.prompt_token_ids = obj["prompt_token_ids"]
            if not self.keep_token_ids:
                obj["prompt_token_ids"] = None
        if isinstance(obj.get("kv_transfer_params"), dict):
            self.kv_transfer_params = obj["kv_transfer_params"]
        if "kv_transfer_params" in obj:
            obj["kv_transfer_params"] = None
        self._usage(obj)
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if isinstance(choice.get("token_ids"), list):
                self.token_ids = list(choice["token_ids"])
                if not self.keep_token_ids:
                    choice["token_ids"] = None
            if isinstance(choice.get("message"), dict):
                self.answer.message(choice["message"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
        return obj


class VllmDecodeStream(DecodeStream):
    """D's SSE answer (an open aiohttp response), parsed as it is read."""

    def __init__(self, resp: aiohttp.ClientResponse, capture: DecodeCapture) -> None:
        self._resp = resp
        self._capture = capture
        self._splitter = SSESplitter()

    @property
    def collected(self) -> DecodeCapture:
        return self._capture

    async def _read_data(self) -> bytes | None:
        if self.done:
            return None
        try:
            data = await self._resp.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise StreamBroken(type(exc).__name__) from exc
        return data or None

    async def read(self) -> list[Piece] | None:
        data = await self._read_data()
        return None if data is None else self._pieces(data)

    async def read_relayed(self) -> bytes | None:
        """A read that holds whole one-line events only, none with anything to change or note, goes to the
        client as D sent it, unsplit: the usual read of a stateless turn's answer (``DecodeCapture.as_is``)."""
        data = await self._read_data()
        if data is None:
            return None
        if not self._splitter.pending and self._capture.as_is(data):
            return data
        return framed(self._pieces(data))

    def _pieces(self, data: bytes) -> list[Piece]:
        cap = self._capture
        out: list[Piece] = []
        for payload in self._splitter.feed(data):
            if payload == DONE:
                self.done = True
                break
            body, visible = cap.chunk(payload)
            out.append((body, visible, cap.error is not None))
        return out

    async def drain(self, timeout_s: float) -> None:
        if self._resp.content.at_eof():
            return  # the usual end: the body's end came with [DONE]
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with asyncio.timeout(timeout_s):  # no task of its own, as wait_for makes
                await self._resp.content.read()

    async def salvage(self, timeout_s: float) -> None:
        if self.done or self._capture.error is not None:
            return
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                async for data in self._resp.content.iter_any():
                    for payload in self._splitter.feed(data):
                        if payload == DONE:
                            self.done = True
                            return
                        self._capture.chunk(payload)

    def close(self) -> None:
        self.closed = True
        let_go(self._resp, read_to_end=self.done)

    def abort(self) -> None:
        self.closed = True
        self._resp.close()
