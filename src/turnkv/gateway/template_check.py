"""``turnkv check-template``: the template audit against one engine, printed for an operator."""

from __future__ import annotations

import aiohttp

from turnkv.config import Timeouts
from turnkv.engine.vllm.engine import VllmEngine
from turnkv.engine.vllm.http import Upstream
from turnkv.errors import UpstreamError
from turnkv.gateway.audit import classify, engine_renderer
from turnkv.reuse.assess import TemplateClass

ADVICE = {
    TemplateClass.PRESERVES: "KV reuse applies to whole turns.",
    TemplateClass.DROPS_REASONING: "each turn's reasoning is dropped on the next turn: turnkv will reuse only "
    "the blocks before the last answer (partial reuse).",
    TemplateClass.REWRITES_HISTORY: "history is re-rendered differently on the next turn: expect little reuse.",
    TemplateClass.UNKNOWN: "",
}


async def check(url: str, model: str | None) -> int:
    base = url.rstrip("/")
    async with aiohttp.ClientSession() as session:
        engine = VllmEngine(Upstream(session, Timeouts()), block_size=16)
        try:
            if model is None:
                cards = await engine.models(base)
                model = cards[0].name if cards else None
            cls, detail = await classify(engine_renderer(engine, base, model))
        except (UpstreamError, ValueError, KeyError, IndexError) as exc:
            print(f"turnkv check-template: could not render on {base}: {exc}")
            return 2
    print(f"{base} ({model}): {cls.value}: {detail}")
    if ADVICE[cls]:
        print(ADVICE[cls])
    return 0
