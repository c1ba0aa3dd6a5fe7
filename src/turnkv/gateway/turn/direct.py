"""DIRECT: whether a turn may go to the decode engine holding the conversation without being rendered.

A decode-local turn uses no handle: D serves it from its own prefix cache, which vLLM keys by the
hashes of the token ids themselves, so it is correct whatever the prompt turned out to be. The token
check guards pulls, not this. What rendering gives a decode-local turn is only the size of the new
part, for the policy's cost estimate; this step estimates it from the new messages' bytes instead
and, when the policy picks decode-local on that estimate, skips the render call, which otherwise
sits on the turn's critical path. Only where nothing suggests the history was rewritten: the
template preserves history, and the client echoed the last answer exactly as D produced it.
Capture still builds the next record from D's own token ids.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from turnkv.gateway.answer import echoed_answer
from turnkv.gateway.turn.context import TurnContext
from turnkv.gateway.turn.plan import likely_prefill_cached
from turnkv.reuse.assess import Reason, TemplateClass
from turnkv.reuse.cost import Action, TurnFacts
from turnkv.state.base import Claim, ClaimStatus

BYTES_PER_TOKEN = 2.5  # English runs ~4, CJK ~3 (a character, ~1 token), hex/base64/JSON 2-3
TOKENS_PER_MESSAGE = 8  # role markers and separators the template adds
# request fields besides the messages that change the prompt the template renders
PROMPT_FIELDS = ("model", "tools", "tool_choice", "chat_template", "chat_template_kwargs", "documents",
                 "add_generation_prompt", "continue_final_message", "add_special_tokens", "cache_salt",
                 "reasoning_effort")


def history_digest(body: Mapping[str, Any], messages: Sequence[Any]) -> str:
    """Digest of ``messages`` with the request fields that shape the prompt; equal digests, equal prompts
    up to the end of these messages (the client sent the same history, tools and template options)."""
    doc = {"messages": list(messages), **{k: body[k] for k in PROMPT_FIELDS if k in body}}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()


def _last_assistant(messages: Sequence[Any]) -> int | None:
    i = len(messages) - 1
    while i >= 0 and isinstance(messages[i], Mapping) and messages[i].get("role") != "assistant":
        i -= 1
    return i if i >= 0 and isinstance(messages[i], Mapping) else None


def _text_tokens(text: str) -> float:
    digits = sum(c.isdigit() for c in text)  # Qwen-style tokenizers give every digit its own token
    return digits + (len(text.encode("utf-8")) - digits) / BYTES_PER_TOKEN


def _content_tokens(content: Any) -> float | None:
    """A message's text, in estimated tokens; None for parts that are not text (an image is many tokens)."""
    if content is None:
        return 0.0
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):
        total = 0.0
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            total += _text_tokens(part["text"])
        return total
    return None


def new_tokens_estimate(messages: Sequence[Any]) -> int | None:
    """Tokens the messages after the last assistant message will add, rounded up; None when there is
    no assistant message (nothing for D to continue) or a message is not text."""
    i = _last_assistant(messages)
    if i is None:
        return None
    tail = messages[i + 1:]
    if not tail or any(not isinstance(m, Mapping) or m.get("role") not in ("user", "tool", "system") for m in tail):
        return None
    sizes = [_content_tokens(m.get("content")) for m in tail]
    if any(n is None for n in sizes):
        return None
    content = sum(n for n in sizes if n is not None)
    # the generation prompt, and the closing of the assistant turn the template re-emits
    return int(content + 0.999) + TOKENS_PER_MESSAGE * (len(tail) + 2)


def applies(ctx: TurnContext) -> bool:
    """Worth reading the record before rendering (instead of beside it): the setting is on, the template
    keeps history, the policy may go decode-local, and the messages continue an answer with text."""
    svc = ctx.svc
    if not (svc.settings.decode_local_direct and svc.audit.cls is TemplateClass.PRESERVES
            and svc.policy.may_decode_local):
        return False
    messages = ctx.body.get("messages") or []
    return echoed_answer(messages) is not None and new_tokens_estimate(messages) is not None


def try_direct(ctx: TurnContext, claim: Claim) -> bool:
    """Set the turn up as decode-local without a render, when the record and the policy allow it."""
    svc = ctx.svc
    rec = claim.record
    if claim.status is not ClaimStatus.FOUND or rec is None or ctx.conversation is None:
        return False
    if rec.tenant != ctx.conversation.tenant or time.time() >= rec.expires_at:
        return False
    # the D routing would pick for this turn must be the one holding the conversation
    d = svc.registry.pick("decode", prefer=rec.decode_url)
    if d is None or d.url != rec.decode_url or (d.epoch is not None and rec.engine_epoch is not None
                                                 and d.epoch != rec.engine_epoch):
        return False
    messages = ctx.body.get("messages") or []
    echoed = echoed_answer(messages)
    if echoed is None or echoed.answer_digest != rec.answer_digest or (
            rec.had_reasoning and echoed.reasoning_digest != rec.reasoning_digest):
        return False
    i = _last_assistant(messages)
    new = new_tokens_estimate(messages)
    if i is None or new is None or rec.history_digest is None \
            or history_digest(ctx.body, messages[:i]) != rec.history_digest:
        return False  # the history before the answer changed (compacted, tools, options): render and check
    bs = svc.settings.block_size
    prefill = svc.registry.pick("prefill", prefer=rec.prefill_url)
    held = (rec.num_tokens // bs) * bs
    facts = TurnFacts(
        prompt_tokens=rec.num_tokens + new, reusable_tokens=rec.num_tokens,
        prefill_cached_tokens=likely_prefill_cached(rec, prefill, bs), decode_cached_tokens=held,
        decode_local_possible=True, decode_busy=d.running,
    )
    decision = svc.policy.decide(facts, svc.estimator.params())
    if decision.action is not Action.DECODE_LOCAL:
        return False
    ctx.action, ctx.reason = Action.DECODE_LOCAL, Reason.DECODE_LOCAL
    ctx.decode_url = rec.decode_url
    ctx.prefill_url = prefill.url if prefill else None  # for a fallback, and the next record
    ctx.expected_cached = held
    ctx.estimates = {k.value: round(v * 1e3, 3) for k, v in decision.estimates.items()}
    ctx.direct = True
    return True
