"""Derender that scales: a tokens-only engine's output ids into OpenAI answers through a render service.

Independent of the gateway: it speaks to render services through ``RenderClient`` and hands back
``Answer``, ``Delta`` and ``Ending`` values, which a front end turns into chat completions or Responses.
"""

from turnkv.derender.answer import Answer, Delta, Ending, Output, ToolCall
from turnkv.derender.client import AiohttpPoster, RenderClient
from turnkv.derender.service import Derender, DerenderConfig, reasoning_open
from turnkv.derender.stream import Chunk, FlushPolicy, FlushStats, StreamDerenderer, relay

__all__ = [
    "AiohttpPoster",
    "Answer",
    "Chunk",
    "Delta",
    "Derender",
    "DerenderConfig",
    "Ending",
    "FlushPolicy",
    "FlushStats",
    "Output",
    "RenderClient",
    "StreamDerenderer",
    "ToolCall",
    "reasoning_open",
    "relay",
]
