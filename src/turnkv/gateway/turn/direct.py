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
from dataclasses import dataclass
from typing import Any

from turnkv.gateway.answer import echoed_answer
from turnkv.gateway.services import Services
from turnkv.gateway.turn.context import TurnContext
from turnkv.gateway.turn.plan import decode_cached, estimates_ms, likely_prefill_cached
from turnkv.reuse.assess import EchoedAnswer, EngineView, Reason, TemplateClass, record_unusable
from turnkv.reuse.cost import Action, TurnFacts
from turnkv.state.base import Claim

# Text bytes per token: measured on the conversation itself at each capture (its messages' bytes over
# its prompt's tokens), and used with a margin; before any measurement, a low guess (English runs ~4,
# CJK ~3: a character, ~1 token; hex, base64 and JSON 2-3). Digits are a token each in Qwen-style
# tokenizers, so they are counted apart.
BYTES_PER_TOKEN = 2.5
MARGIN = 1.25  # the new text may tokenize worse than the history did
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


def last_assistant(messages: Sequence[Any]) -> int | None:
    """Index of the last assistant message; None when there is none (a conversation's first turn)."""
    i = len(messages) - 1
    while i >= 0 and isinstance(messages[i], Mapping) and messages[i].get("role") != "assistant":
        i -= 1
    return i if i >= 0 and isinstance(messages[i], Mapping) else None


_DIGITS = b"0123456789"  # tokenizers give each its own token


def _content_size(content: Any) -> tuple[int, int] | None:
    """(digits, other UTF-8 bytes) of a message's text; None for parts that are not text (an image is
    many tokens)."""
    texts: list[str] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            texts.append(part["text"])
    elif content is not None:
        return None
    raw = [t.encode("utf-8") for t in texts]
    size = sum(len(b) for b in raw)
    other = sum(len(b.translate(None, _DIGITS)) for b in raw)  # in C: histories run to 100s of KB
    return size - other, other


def text_size(messages: Sequence[Any]) -> tuple[int, int] | None:
    """(digits, other bytes) of the messages' text; None when one is not a message of text."""
    total_d = total_b = 0
    for m in messages:
        size = _content_size(m.get("content")) if isinstance(m, Mapping) else None
        if size is None:
            return None
        total_d, total_b = total_d + size[0], total_b + size[1]
    return total_d, total_b


def bytes_per_token(messages: Sequence[Any], prompt_tokens: int) -> float | None:
    """What this conversation's text measured: its non-digit bytes per non-digit prompt token (the
    template's own tokens count in, which keeps the figure low, so estimates from it high)."""
    size = text_size(messages)
    if size is None or prompt_tokens - size[0] <= 0 or size[1] <= 0:
        return None
    return min(8.0, max(1.0, size[1] / (prompt_tokens - size[0])))


@dataclass(frozen=True)
class Candidate:
    """A turn that continues an answer with text only: what the record is held against."""

    echoed: EchoedAnswer
    answer_at: int  # index of the last assistant message
    new_messages: int  # messages after it
    new_size: tuple[int, int]  # their (digits, other bytes)

    def new_tokens(self, measured_bytes_per_token: float | None = None) -> int:
        """Tokens the new messages will add, rounded up."""
        bpt = measured_bytes_per_token / MARGIN if measured_bytes_per_token else BYTES_PER_TOKEN
        digits, other = self.new_size
        # the generation prompt, and the closing of the assistant turn the template re-emits
        return int(digits + other / bpt + 0.999) + TOKENS_PER_MESSAGE * (self.new_messages + 2)


def continuation(messages: Sequence[Any]) -> Candidate | None:
    """The messages as a continuation of their last answer with text only; None when there is no
    assistant message (nothing for D to continue), nothing after it, or a message is not text."""
    i = last_assistant(messages)
    if i is None:
        return None
    tail = messages[i + 1:]
    if not tail or any(not isinstance(m, Mapping) or m.get("role") not in ("user", "tool", "system") for m in tail):
        return None
    size = text_size(tail)
    echoed = echoed_answer(messages)
    if size is None or echoed is None:
        return None
    return Candidate(echoed, i, len(tail), size)


def enabled(svc: Services, *, until_audited: bool = False) -> bool:
    """The setting is on and the template keeps history: direct turns are possible at all (with
    ``until_audited``, also while the start-up audit has not classified the template yet)."""
    ok = (TemplateClass.PRESERVES, TemplateClass.UNKNOWN) if until_audited else (TemplateClass.PRESERVES,)
    return svc.settings.decode_local_direct and svc.audit.cls in ok


def candidate(ctx: TurnContext) -> Candidate | None:
    """The turn, when it is worth reading the record before rendering (instead of beside it): direct
    turns are enabled, the policy may go decode-local, and the messages continue an answer with text."""
    if not (enabled(ctx.svc) and ctx.svc.policy.may_decode_local):
        return None
    return continuation(ctx.body.get("messages") or [])


def try_direct(ctx: TurnContext, claim: Claim, cand: Candidate) -> bool:
    """Set the turn up as decode-local without a render, when the record and the policy allow it."""
    svc = ctx.svc
    rec = claim.record
    if rec is None or ctx.conversation is None:
        return False
    # the D routing would pick for this turn must be the one holding the conversation
    d = svc.registry.pick("decode", prefer=rec.decode_url)
    view = EngineView(d.routable, d.epoch) if d is not None and d.url == rec.decode_url else None
    if record_unusable(claim, tenant=ctx.conversation.tenant, now=time.time(), decode=view) is not None:
        return False
    assert d is not None
    if not svc.pins.room_for_local(d):
        return False  # rendered and planned: the plan says why
    echoed = cand.echoed
    if echoed.answer_digest != rec.answer_digest or (
            rec.had_reasoning and echoed.reasoning_digest != rec.reasoning_digest):
        return False
    messages = ctx.body.get("messages") or []
    if rec.history_digest is None or history_digest(ctx.body, messages[:cand.answer_at]) != rec.history_digest:
        return False  # the history before the answer changed (compacted, tools, options): render and check
    new = cand.new_tokens(rec.bytes_per_token)
    bs = svc.settings.block_size
    prefill = svc.registry.pick("prefill", prefer=rec.prefill_url)
    held = decode_cached(rec, rec.num_tokens, bs)
    facts = TurnFacts(
        prompt_tokens=rec.num_tokens + new, reusable_tokens=rec.num_tokens if rec.handle is not None else 0,
        prefill_cached_tokens=likely_prefill_cached(rec, prefill, bs), decode_cached_tokens=held,
        decode_local_possible=True, decode_busy=d.busy,
    )
    decision = svc.policy.decide(facts, svc.estimator.params())
    if decision.action is not Action.DECODE_LOCAL:
        return False
    ctx.action, ctx.reason = Action.DECODE_LOCAL, Reason.DECODE_LOCAL
    ctx.decode_url = rec.decode_url
    ctx.prefill_url = prefill.url if prefill else None  # for a fallback, and the next record
    ctx.expected_cached = held
    ctx.estimates = estimates_ms(decision)
    ctx.direct = True
    return True
