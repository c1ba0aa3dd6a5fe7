"""OpenAI's server-sent events: split a byte stream into event payloads, and frame payloads again.

Used by the engine readers (``engine.vllm.stream``) and by the front ends that translate a relayed chat
stream (``gateway.responses``).
"""

from __future__ import annotations

DONE = b"[DONE]"


class SSESplitter:
    """Splits bytes into SSE events; returns each event's data payload (``data:`` lines joined)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while True:
            i = self._buf.find(b"\n\n")
            j = self._buf.find(b"\r\n\r\n")
            if i < 0 and j < 0:
                return out
            if j >= 0 and (i < 0 or j < i):
                event, self._buf = self._buf[:j], self._buf[j + 4 :]
            else:
                event, self._buf = self._buf[:i], self._buf[i + 2 :]
            lines = [ln[5:].lstrip(b" ") for ln in event.splitlines() if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))

    @property
    def pending(self) -> bool:
        return bool(self._buf.strip())


def frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
