"""``turnkv check-template``: the template audit against one engine, printed for an operator."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from turnkv.config import Timeouts
from turnkv.errors import UpstreamError
from turnkv.gateway.audit import classify, engine_renderer
from turnkv.gateway.upstream import Upstream
from turnkv.reuse.assess import TemplateClass

ADVICE = {
    TemplateClass.PRESERVES: "KV reuse applies to whole turns.",
    TemplateClass.DROPS_REASONING: "each turn's reasoning is dropped on the next turn: turnkv will reuse only "
                                   "the blocks before the last answer (partial reuse).",
    TemplateClass.REWRITES_HISTORY: "history is re-rendered differently on the next turn: expect little reuse.",
    TemplateClass.UNKNOWN: "",
}


async def check(engine: str, model: str | None) -> int:
    base = engine.rstrip("/")
    async with aiohttp.ClientSession() as session:
        up = Upstream(session, Timeouts())
        try:
            if model is None:
                status, raw = await up.get(base, "/v1/models")
                model = json.loads(raw)["data"][0]["id"] if status == 200 else None

            async def post(body: dict[str, Any]) -> dict[str, Any]:
                return await up.post_json("render", base, "/v1/chat/completions/render", body, up.headers(None, None))

            cls, detail = await classify(engine_renderer(post, model))
        except (UpstreamError, ValueError, KeyError, IndexError) as exc:
            print(f"turnkv check-template: could not render on {base}: {exc}")
            return 2
    print(f"{base} ({model}): {cls.value}: {detail}")
    if ADVICE[cls]:
        print(ADVICE[cls])
    return 0
