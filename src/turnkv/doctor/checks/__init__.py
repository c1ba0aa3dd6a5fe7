"""The doctor's judgements: pure functions from what was observed (``doctor.facts``) and the gateway's
settings to findings (``doctor.findings``), one module per part of the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from turnkv.config import Settings
from turnkv.doctor.facts import EngineFacts, HostFacts, TemplateFacts, TransferFacts
from turnkv.engine.diagnostics import Advice


@dataclass(frozen=True)
class Context:
    settings: Settings
    advice: Callable[[Advice], str]  # the engine family's fix for a problem
    checks_tokens: bool = True  # the configured policy checks tokens before it pulls
    turn_tokens: int = 150  # new tokens in a turn, for the break-even
    history_tokens: int = 16384  # a conversation's length, for decode memory


@dataclass(frozen=True)
class Observed:
    prefill: tuple[EngineFacts, ...]
    decode: tuple[EngineFacts, ...]
    render: EngineFacts | None  # the render setting's engine, when it is none of the above
    template: TemplateFacts | None
    transfer: TransferFacts | None
    host: HostFacts

    @property
    def engines(self) -> tuple[EngineFacts, ...]:
        return (*self.prefill, *self.decode)

    def engine(self, url: str) -> EngineFacts | None:
        return next((e for e in (*self.engines, *([self.render] if self.render else [])) if e.url == url), None)
