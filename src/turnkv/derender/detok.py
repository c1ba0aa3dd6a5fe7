"""Text deltas of a growing list of output ids, decoding a short window each time, never the whole output.

A ``TextSource`` turns ids into text: the model's tokenizer in this process (``LocalText``), or the render
service's ``/detokenize`` (``RemoteText``: one call each). ``IncrementalText`` keeps an anchor a few
tokens back and decodes from it, as vLLM's own incremental detokenizer does with its prefix and read
offsets: the text the anchor's window already gave is known, so one decode per push gives the new text.
When the window grows past ``window`` tokens the anchor moves up (one more decode, for the new window's
known part). Text that ends in an incomplete character (U+FFFD) waits for the next ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from turnkv.derender.client import RenderClient

REPLACEMENT = "\ufffd"


class TextSource(Protocol):
    async def decode(self, ids: Sequence[int]) -> str: ...


class LocalText:
    """A tokenizer's decode function, in process (special tokens kept, as the parsers see them)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.calls = 0

    async def decode(self, ids: Sequence[int]) -> str:
        self.calls += 1
        return self._decode(ids)


class RemoteText:
    """The render service's ``/detokenize``."""

    def __init__(self, client: RenderClient) -> None:
        self.client = client
        self.calls = 0

    async def decode(self, ids: Sequence[int]) -> str:
        self.calls += 1
        return await self.client.detokenize(ids)


class IncrementalText:
    """New text as ids are pushed (see the module docstring)."""

    def __init__(self, source: TextSource, *, context: int = 4, window: int = 256) -> None:
        self.source = source
        self.context = context
        self.window = window
        self.ids: list[int] = []
        self._anchor = 0  # the window starts here
        self._done = 0  # ids whose text was given out
        self._known = ""  # decode(ids[anchor:done])
        self.text = ""  # all text given out

    async def push(self, ids: Sequence[int], *, final: bool = False) -> str:
        self.ids += ids
        if self._done == len(self.ids):
            return ""
        if self._done - self._anchor > self.window:
            self._anchor = max(self._done - self.context, 0)
            self._known = await self.source.decode(self.ids[self._anchor : self._done])
        full = await self.source.decode(self.ids[self._anchor :])
        if not final and full.endswith(REPLACEMENT):
            return ""  # an incomplete character: wait for its other bytes
        # As vLLM: what the window decodes to past its known text's length is new (a tokenizer's clean-up at
        # the seam can change a character before it; the final derender says what the text really is).
        delta = full[len(self._known) :]
        self._known = full
        self._done = len(self.ids)
        self.text += delta
        return delta
