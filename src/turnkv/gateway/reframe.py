"""A relayed chat completion stream re-framed as another API's named events (Anthropic's Messages stream,
OpenAI's Responses stream): the front ends' translators say which events each chunk makes; this reads the
chat stream's SSE, frames their events and closes the stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from turnkv.openai.sse import DONE, SSESplitter

Event = dict[str, Any]


def frame(event: Event) -> bytes:
    """One named event (``event: <type>``) as the stream sends it."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def reframed(
    chat: Any,
    start: Callable[[], list[Event]],
    chunk: Callable[[Mapping[str, Any]], list[Event]],
    finish: Callable[[], Awaitable[list[Event]]],
) -> AsyncIterator[bytes]:
    """``start``'s events, then each chat chunk's events (``chunk``) and at ``[DONE]`` ``finish``'s; the events
    one read of ``chat`` made go out together. Unreadable payloads are passed over; ``chat`` is closed at the
    end, whichever way the stream ends."""
    splitter = SSESplitter()
    try:
        yield b"".join(frame(e) for e in start())
        async for data in chat:
            out: list[Event] = []
            for payload in splitter.feed(data if isinstance(data, bytes) else str(data).encode()):
                if payload == DONE:
                    out += await finish()
                    continue
                try:
                    obj = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    out += chunk(obj)
            if out:
                yield b"".join(frame(e) for e in out)
    finally:
        aclose = getattr(chat, "aclose", None)
        if aclose is not None:
            await aclose()
