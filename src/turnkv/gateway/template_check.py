"""``turnkv check-template``: the template audit against one engine, printed for an operator.

The engine is the one the gateway's settings name (``engine``, its key, its timeouts), opened through the
same factory (``turnkv.engine.open_engine``), so the check renders as the gateway would.
"""

from __future__ import annotations

from turnkv.config import ConfigError, load_settings
from turnkv.engine import open_engine
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


async def check(url: str, model: str | None, config_file: str | None = None) -> int:
    base = url.rstrip("/")
    try:
        # the engines of the settings do not matter here: the check renders on ``base`` alone
        settings = load_settings(config_file, render=base, prefill=[base], decode=[base])
        opened = open_engine(settings)
    except ConfigError as exc:
        print(f"turnkv check-template: {exc}")
        return 2
    async with opened as engine:
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
