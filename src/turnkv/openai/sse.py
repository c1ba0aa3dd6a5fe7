"""OpenAI's server-sent events: split a byte stream into event payloads, and frame payloads again.

Used by the engine readers (``engine.vllm.stream``), the relay (``gateway.turn.stream``) and the front ends
that translate a relayed chat stream (``gateway.reframe``).
"""

from __future__ import annotations

DONE = b"[DONE]"


class SSESplitter:
    """Splits bytes into SSE events; returns each event's data payload (``data:`` lines joined)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        # one pass over what one read brought: events are cut by position, not by slicing the rest of the
        # buffer after each (a batch of N events cost N copies of it), and CRLF ends are looked for only
        # in a buffer that holds a CR
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos = 0
        crlf = -1 if b"\r" in buf else None  # None: no CRLF end anywhere; else the next one (or -1: find it)
        while True:
            i = buf.find(b"\n\n", pos)
            if crlf is not None and crlf < pos:
                crlf = buf.find(b"\r\n\r\n", pos)
                if crlf < 0:
                    crlf = None
            if crlf is not None and (i < 0 or crlf < i):
                event, pos = buf[pos:crlf], crlf + 4
            elif i >= 0:
                event, pos = buf[pos:i], i + 2
            else:
                break
            if event.startswith(b"data:") and b"\n" not in event and b"\r" not in event:
                out.append(event[5:].lstrip(b" "))  # the usual event: one data line
                continue
            lines = [ln[5:].lstrip(b" ") for ln in event.splitlines() if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        self._buf = buf[pos:] if pos else buf
        return out

    @property
    def pending(self) -> bool:
        return bool(self._buf.strip())


def frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
