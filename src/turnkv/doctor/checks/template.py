"""The chat template: whether the gateway can render turns where it renders them (its ``render`` setting,
else the first prefill engine), what the template does to history one turn later (``gateway.audit``),
and, where D renders the turn itself, whether D's ids are the render's."""

from __future__ import annotations

from turnkv.doctor.checks import Context, Observed
from turnkv.doctor.findings import Finding, Item, Verdict
from turnkv.engine.diagnostics import Advice
from turnkv.reuse.assess import TemplateClass

_CLASS_TEXT = {
    TemplateClass.PRESERVES: "keeps history token for token: whole turns are reused",
    TemplateClass.DROPS_REASONING: "drops each answer's reasoning on the next turn: turnkv reuses only the blocks "
    "before the last answer (partial reuse)",
    TemplateClass.REWRITES_HISTORY: "re-renders history differently on the next turn: little or nothing of D's KV "
    "matches the next prompt",
}


def check(obs: Observed, ctx: Context) -> list[Finding]:
    t = obs.template
    if t is None:
        return [Finding(Item.TEMPLATE, Verdict.SKIPPED, "no engine to audit the chat template on")]
    out = [_render(obs, ctx)]
    out.append(_template(obs, ctx))
    if t.decode_agrees is False:
        out.append(
            Finding(
                Item.TEMPLATE,
                Verdict.FAIL,
                f"D renders a chat turn to other token ids than {t.target}: D renders each turn itself (it takes "
                "no prompt ids), so its KV would not match the prompt P computed",
                fix="render with the engine D runs (the same chat template, tokenizer and version), or run a D "
                "that takes prompt ids",
            )
        )
    return out


def _render(obs: Observed, ctx: Context) -> Finding:
    t = obs.template
    assert t is not None
    target = obs.engine(t.target)
    d = target.description if target is not None else None
    where = f"{t.target} ({'the render setting' if t.configured else 'no render setting: the first prefill engine'})"
    if d is None:
        return Finding(Item.RENDER, Verdict.FAIL, f"the gateway renders on {where}, which did not answer")
    if d.tokenizer is False:
        able = [e.url for e in obs.engines if e.description is not None and e.description.tokenizer]
        fix = (
            f"set render: {able[0]} (TURNKV_RENDER), an engine with the tokenizer"
            if able
            else ctx.advice(Advice.NO_TOKENIZER)
        )
        return Finding(
            Item.RENDER,
            Verdict.FAIL,
            f"the gateway renders chat turns on {where}, which has no tokenizer ({d.tokenizer_detail}): "
            "no chat turn could be planned or checked",
            fix=fix,
            engine=t.target,
        )
    return Finding(Item.RENDER, Verdict.OK, f"the gateway renders on {where}", engine=t.target)


def _template(obs: Observed, ctx: Context) -> Finding:
    t = obs.template
    assert t is not None
    if t.cls is None or t.cls is TemplateClass.UNKNOWN:
        return Finding(Item.TEMPLATE, Verdict.WARN, f"the chat template could not be audited: {t.detail}")
    tools = "" if t.tools else " (audited without tools: the template refused the tool probe)"
    text = f"the chat template {_CLASS_TEXT[t.cls]}{tools}"
    data = {"class": t.cls.value, "detail": t.detail}
    if t.cls is TemplateClass.PRESERVES:
        return Finding(Item.TEMPLATE, Verdict.OK, text, data=data)
    if t.cls is TemplateClass.DROPS_REASONING:
        return Finding(
            Item.TEMPLATE,
            Verdict.WARN,
            text,
            fix="for agents, serve a chat template that keeps earlier turns' reasoning (the engine's "
            "--chat-template), or accept partial reuse",
            data=data,
        )
    if not ctx.checks_tokens:
        return Finding(
            Item.TEMPLATE,
            Verdict.FAIL,
            f"{text}; the configured policy pulls D's KV without checking the tokens, so its pulls would "
            "compute answers from the wrong positions",
            fix="use a policy that checks tokens (adaptive, the default) or a template that keeps history",
            data=data,
        )
    return Finding(
        Item.TEMPLATE,
        Verdict.WARN,
        f"{text}; turnkv's token check finds it every turn and recomputes instead",
        fix="serve a chat template that renders history the same on every turn (the engine's --chat-template)",
        data=data,
    )
