"""Decode memory: how many conversations of a given length each D can hold pinned within turnkv's budget
(``decode_memory.pin_budget_share`` of its KV), at what load turnkv stops pinning and gives pins back
(``pressure_kv_usage``), and whether the gateway's idea of D's handle lifetime matches D's."""

from __future__ import annotations

from turnkv.doctor.checks import Context, Observed
from turnkv.doctor.checks.fmt import tokens
from turnkv.doctor.facts import EngineFacts
from turnkv.doctor.findings import Finding, Item, Verdict

FEW = 4  # fewer conversations than this pinned at once: pulls will rarely find their handle


def check(obs: Observed, ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    for e in obs.decode:
        if e.description is not None:
            out.append(_budget(e, ctx))
            out += _ttl(e, ctx)
    return out


def _budget(e: EngineFacts, ctx: Context) -> Finding:
    dm = ctx.settings.decode_memory
    d = e.description
    assert d is not None
    cap = d.capacity_tokens if d.capacity_tokens is not None else dm.capacity_tokens
    if cap is None:
        return Finding(
            Item.DECODE_MEMORY,
            Verdict.WARN,
            f"decode {e.url} does not say its KV capacity: turnkv cannot budget pins there and releases each at once",
            fix="set decode_memory.capacity_tokens to D's KV capacity in tokens",
            engine=e.url,
        )
    bs = d.block_size or ctx.settings.block_size
    length = min(ctx.history_tokens, e.max_model_len or ctx.history_tokens)
    per = -(-length // bs) * bs
    budget = int(cap * dm.pin_budget_share)
    pinned = budget // per
    data = {
        "capacity_tokens": cap,
        "budget_tokens": budget,
        "conversation_tokens": length,
        "conversations": pinned,
        "conversations_in_all_kv": cap // per,
        "pressure_tokens": int(cap * dm.pressure_kv_usage),
    }
    text = (
        f"decode {e.url}: KV {tokens(cap)} tokens; turnkv pins up to {dm.pin_budget_share:.0%} of it "
        f"({tokens(budget)} tokens): {pinned} conversations of {tokens(length)} tokens at once "
        f"({cap // per} would fill D). It stops pinning and gives pins back down to "
        f"{dm.pressure_keep_share:.0%} when D's KV usage reaches {dm.pressure_kv_usage:.0%} "
        f"(about {tokens(cap * dm.pressure_kv_usage)} tokens in use), or when requests wait on D while pins hold more "
        f"than {dm.pressure_keep_share:.0%}"
    )
    if pinned < FEW:
        return Finding(
            Item.DECODE_MEMORY,
            Verdict.WARN,
            text,
            fix="give D more KV (--gpu-memory-utilization, a smaller --max-model-len) or raise "
            "decode_memory.pin_budget_share",
            engine=e.url,
            data=data,
        )
    return Finding(Item.DECODE_MEMORY, Verdict.OK, text, engine=e.url, data=data)


def _ttl(e: EngineFacts, ctx: Context) -> list[Finding]:
    d = e.description
    t = d.transfer if d is not None else None
    if t is None or t.decoder_ttl_s is None:
        return []
    mine = ctx.settings.decoder_kv_blocks_ttl
    if abs(t.decoder_ttl_s - mine) < 1:
        return []
    verdict = Verdict.FAIL if mine > t.decoder_ttl_s else Verdict.WARN
    why = (
        "the gateway would hand P handles whose blocks D has already freed, and every such pull fails"
        if verdict is Verdict.FAIL
        else "the gateway forgets handles before D frees them"
    )
    return [
        Finding(
            Item.DECODE_MEMORY,
            verdict,
            f"decode {e.url} frees pinned blocks after {t.decoder_ttl_s:g} s, the gateway's decoder_kv_blocks_ttl "
            f"is {mine:g} s: {why}",
            fix=f"set decoder_kv_blocks_ttl: {t.decoder_ttl_s:g}",
            engine=e.url,
        )
    ]
