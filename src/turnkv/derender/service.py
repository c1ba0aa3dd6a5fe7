"""One render service (or several replicas) as a derenderer: whole answers, and streams the cheapest way it allows.

``Derender.whole`` is one non-streaming derender call. ``Derender.stream`` picks, per stream, how a streamed
answer is derendered (``stream``): turnkv's incremental path wherever turnkv reads the configured parsers'
markup, else vLLM's streaming derender on a render service from 0.31, else the whole answer at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from turnkv.derender.answer import Answer, Output, answer_of, derender_request
from turnkv.derender.client import RenderClient
from turnkv.derender.detok import IncrementalText, LocalText, RemoteText, TextSource
from turnkv.derender.markup import MarkupSplitter, markup_for
from turnkv.derender.stream import (
    FinalOnlyDerender,
    FlushPolicy,
    IncrementalDerender,
    StreamDerenderer,
    VllmStreamDerender,
)

STREAMING_DERENDER = (0, 31)  # streaming derender with reasoning and tool parsers (0.27: without parsers)


@dataclass(frozen=True)
class DerenderConfig:
    """How streamed answers are derendered. The parser names are those the render service was started with
    (``--reasoning-parser``, ``--tool-call-parser``; None: not configured)."""

    reasoning_parser: str | None = "qwen3"
    tool_parser: str | None = "hermes"
    mode: Literal["auto", "incremental", "vllm-stream", "final"] = "auto"
    policy: FlushPolicy = field(default_factory=FlushPolicy)
    # tokens an incremental decode covers before its anchor moves up: from the render service a wide window (a
    # call each time it moves), in process a narrow one (each decode's cost grows with it)
    window: int = 256
    local_window: int = 16


def reasoning_open(rendered: Mapping[str, Any], chat_request: Mapping[str, Any]) -> bool:
    """Whether the model starts its answer in reasoning: render's ``reasoning_ended`` where it says it (0.27+),
    else the request's ``enable_thinking`` (or ``reasoning_effort: none``), as the qwen3 parser reads them."""
    ended = rendered.get("reasoning_ended")
    if isinstance(ended, bool):
        return not ended
    kwargs = chat_request.get("chat_template_kwargs")
    kwargs = kwargs if isinstance(kwargs, Mapping) else {}
    if "enable_thinking" in kwargs:
        return kwargs["enable_thinking"] is not False
    return chat_request.get("reasoning_effort") != "none"


def parses_tools(chat_request: Mapping[str, Any]) -> bool:
    return bool(chat_request.get("tools")) and chat_request.get("tool_choice") != "none"


class Derender:
    """Derendering through ``client`` for render services of ``version``."""

    def __init__(
        self,
        client: RenderClient,
        version: tuple[int, int],
        config: DerenderConfig | None = None,
        *,
        local_decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self.client = client
        self.version = version
        self.config = config or DerenderConfig()
        self.local_decode = local_decode  # the model's tokenizer in this process, when there is one

    async def whole(
        self,
        out: Output,
        *,
        model: str | None,
        prompt_ids: Sequence[int],
        chat_request: Mapping[str, Any] | None,
    ) -> Answer:
        body = derender_request(self.version, model, out, prompt_ids=prompt_ids, chat_request=chat_request)
        got = await self.client.derender_chat(body)
        return answer_of(got, tool_choice=(chat_request or {}).get("tool_choice"))

    def text_source(self) -> tuple[TextSource, bool]:
        """Where incremental text comes from, and whether that costs a render-service call."""
        if self.local_decode is not None:
            return LocalText(self.local_decode), False
        return RemoteText(self.client), True

    def mode(self) -> str:
        c = self.config
        if c.mode != "auto":
            return c.mode
        if markup_for(c.reasoning_parser, c.tool_parser) is not None:
            return "incremental"
        return "vllm-stream" if self.version >= STREAMING_DERENDER else "final"

    def stream(
        self,
        *,
        model: str | None,
        prompt_ids: Sequence[int],
        chat_request: Mapping[str, Any],
        request_id: str,
        reasoning_open: bool,
    ) -> StreamDerenderer:
        async def whole(out: Output) -> Answer:
            return await self.whole(out, model=model, prompt_ids=prompt_ids, chat_request=chat_request)

        mode = self.mode()
        markup = markup_for(self.config.reasoning_parser, self.config.tool_parser)
        if mode == "incremental" and markup is not None:
            source, remote = self.text_source()
            text = IncrementalText(source, window=self.config.window if remote else self.config.local_window)
            splitter = MarkupSplitter(markup, reasoning_open=reasoning_open, parse_tools=parses_tools(chat_request))
            return IncrementalDerender(text, splitter, whole, remote=remote)
        if mode == "vllm-stream" and self.version >= STREAMING_DERENDER:
            return VllmStreamDerender(
                self.client, model=model, prompt_ids=prompt_ids, chat_request=chat_request, request_id=request_id
            )
        return FinalOnlyDerender(whole)
