"""The chat template as the gateway will meet it: the start-up audit (``gateway.audit.classify``) run on the
gateway's render target, and, where D renders each turn itself, whether D's ids are the target's."""

from __future__ import annotations

from turnkv.doctor.facts import EngineFacts, TemplateFacts
from turnkv.engine.base import Engine
from turnkv.errors import UpstreamError, UpstreamStatus
from turnkv.gateway.audit import classify, engine_renderer, probe_history


async def audit(
    engine: Engine, target: EngineFacts, configured: bool, decode: EngineFacts | None, model: str | None
) -> TemplateFacts:
    d = target.description
    if d is None or d.tokenizer is False:
        why = "did not answer" if d is None else d.tokenizer_detail
        return TemplateFacts(target.url, configured, None, f"{target.url} cannot render: {why}")
    tools = True
    try:
        try:
            cls, detail = await classify(engine_renderer(engine, target.url, model))
        except UpstreamStatus as exc:
            if exc.upstream_status >= 500:
                raise
            tools = False  # the template may not take tools: the probe without tool calls
            cls, detail = await classify(engine_renderer(engine, target.url, model, tools=False), tools=False)
    except (UpstreamError, ValueError, KeyError) as exc:
        return TemplateFacts(target.url, configured, None, f"the audit failed on {target.url}: {exc}")
    agrees = await _decode_agrees(engine, target.url, decode, model, tools) if decode is not None else None
    return TemplateFacts(target.url, configured, cls, detail, tools=tools, decode_agrees=agrees)


async def _decode_agrees(
    engine: Engine, target: str, decode: EngineFacts, model: str | None, tools: bool
) -> bool | None:
    """Whether D renders the audit's conversation to the target's ids, where D renders turns itself (it
    takes no prompt ids) and is not the target; None where that does not apply or cannot be told."""
    d = decode.description
    if d is None or d.takes_prompt_ids or decode.url == target or not d.tokenizer:
        return None
    messages = probe_history(tools)
    renders = []
    for url in (target, decode.url):
        render = engine_renderer(engine, url, model, tools=tools)
        try:
            renders.append(list(await render(list(messages), True)))
        except (UpstreamError, ValueError):
            return None
    return renders[0] == renders[1]
