"""Decides how much of a stored decode handle a new prompt may safely reuse, and why not more.

Pure: given the claimed record, the new prompt's token ids and a few facts about the engines, it
returns the number of tokens of D's KV that are exactly the new prompt's first tokens (block
aligned unless D's whole sequence matches) and a reason code. The token chain is the authority;
the facts only explain a divergence (reasoning dropped, answer edited, retokenized, history
edited) or rule the handle out (expired, other tenant, engine restarted).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from turnkv.openai.answer import EchoedAnswer
from turnkv.reuse.chain import ChainBuilder, agreement
from turnkv.state.base import Claim, ClaimStatus
from turnkv.state.record import ConversationRecord


class Reason(enum.StrEnum):
    FULL_MATCH = "full_match"
    NO_SESSION = "no_session"
    NO_RECORD = "no_record"
    CONCURRENT_TURN = "concurrent_turn"
    CORRUPT_RECORD = "corrupt_record"
    STORE_UNAVAILABLE = "store_unavailable"
    STORE_BUSY = "store_busy"  # every store connection stayed busy past the pool wait: this turn only
    RENDER_FAILED = "render_failed"
    REQUEST_REJECTED = "request_rejected"  # the render refused the request as the client sent it (a 4xx)
    UNSUPPORTED_REQUEST = "unsupported_request"
    EXPIRED = "expired"
    TENANT = "tenant"
    ENGINE_RESTARTED = "engine_restarted"
    DECODE_UNAVAILABLE = "decode_unavailable"
    BLOCK_SIZE_CHANGED = "block_size_changed"
    HISTORY_EDITED = "history_edited"
    REASONING_STRIPPED = "reasoning_stripped"  # the chat template drops earlier reasoning
    REASONING_DROPPED = "client_dropped_reasoning"  # the client sent the answer back without its reasoning
    ANSWER_EDITED = "answer_edited"
    ANSWER_AS_TEXT = "answer_as_text"  # the client sent the answer's tool calls back as text
    RETOKENIZED = "retokenized"
    PROMPT_SHORTER = "prompt_shorter"
    CHEAPER_TO_RECOMPUTE = "cheaper_to_recompute"
    DECODE_LOCAL = "decode_local"
    ITL_BUDGET = "itl_budget"  # decode-local would have been fastest, but would push D's ITL past the budget
    # ... but its prefill (with the other decode-local prefills on D) would lengthen D's step past the headroom
    ITL_HEADROOM = "itl_headroom"
    # decode-local past the ITL checks: P shares D's GPU, and the path through P would prefill as much there
    SHARED_GPU = "shared_gpu"
    PULL_FAILED = "pull_failed"
    PIN_RELEASED = "pin_released"  # the stored handle was given back (budget, pressure, not worth its bytes)
    # the stored handle went to P in a turn that then failed: the record was kept, the history is in P's cache
    HANDLE_SPENT = "handle_spent"
    WRITTEN_BACK = "written_back"  # D's KV was handed to P's prefix cache after the last turn: P computes the rest
    NO_HANDLE_IN_STREAM = "no_handle_in_stream"  # D's stream carried no handle (vLLM < 0.33 without the plugin)
    FIRST_TOKEN_DEADLINE = "first_token_deadline"  # an engine missed it; the turn ran another way
    DECODE_FAILED = "decode_failed"  # D failed before its first token; the turn ran again as plain P/D
    DECODE_BUSY = "decode_busy"  # D's KV is nearly full, or turns wait in the gateway for room on it: not decode-local
    DECODE_QUEUE = "decode_queue"  # requests wait on D longer than the turn would wait at P: not decode-local
    DECODE_MOVED = "decode_moved"  # routing put the turn on another D than the one holding it (by load)
    PREFILL_BUSY = "prefill_busy"  # a first turn ran on D: P's queue made P's path the slower (``turn.plan``)


class TemplateClass(enum.StrEnum):
    PRESERVES = "preserves"
    DROPS_REASONING = "drops_reasoning"
    REWRITES_HISTORY = "rewrites_history"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class EngineView:
    healthy: bool
    epoch: float | None  # process start time, when known


@dataclass(frozen=True)
class Assessment:
    record: ConversationRecord | None
    tokens: int  # reusable tokens of D's KV, 0 when none
    full: bool
    reason: Reason
    releasable: bool  # the handle may still be pinned on a live D: release it if unused

    @property
    def outcome(self) -> str:
        return "full" if self.full else ("partial" if self.tokens > 0 else "none")

    @classmethod
    def whole(cls, record: ConversationRecord) -> Assessment:
        """D's whole sequence taken to match: proved by the record before any render, or believed unchecked
        (the baselines that check no tokens, as vLLM's example proxy does)."""
        return cls(record, record.num_tokens, True, Reason.FULL_MATCH, True)


def _none(reason: Reason, record: ConversationRecord | None = None, releasable: bool = False) -> Assessment:
    return Assessment(record, 0, False, reason, releasable)


# reasons ``record_unusable`` gives while a record exists and belongs to the tenant
_RECORD_KEPT = frozenset({Reason.EXPIRED, Reason.DECODE_UNAVAILABLE, Reason.ENGINE_RESTARTED})


def record_unusable(claim: Claim, *, tenant: str, now: float, decode: EngineView | None) -> Reason | None:
    """Why the claimed record cannot serve this turn whatever the prompt is; None when it may."""
    if claim.status is ClaimStatus.MISSING:
        return Reason.NO_RECORD
    if claim.status is ClaimStatus.IN_FLIGHT:
        return Reason.CONCURRENT_TURN
    if claim.status is ClaimStatus.CORRUPT or claim.record is None:
        return Reason.CORRUPT_RECORD
    r = claim.record
    if r.tenant != tenant:
        return Reason.TENANT
    if now >= r.expires_at:
        return Reason.EXPIRED
    if decode is None or not decode.healthy:
        return Reason.DECODE_UNAVAILABLE
    if decode.epoch is not None and r.engine_epoch is not None and decode.epoch != r.engine_epoch:
        return Reason.ENGINE_RESTARTED
    return None


def assess(
    claim: Claim,
    prompt: Sequence[int],
    *,
    tenant: str,
    now: float,
    decode: EngineView | None,
    echoed: EchoedAnswer | None,
    template: TemplateClass,
    block_size: int,
    prompt_chain: ChainBuilder | None = None,
    proved: bool = False,
) -> Assessment:
    """``prompt_chain``: the prompt's chain when the caller has it; ``proved``: the caller found that the
    prompt starts with the record's whole sequence by its digest (``chain.proves``). Both only save work."""
    why = record_unusable(claim, tenant=tenant, now=now, decode=decode)
    if why is not None:
        return _none(why, claim.record if why in _RECORD_KEPT else None)
    r = claim.record
    assert r is not None
    if r.block_size != block_size:
        return _none(Reason.BLOCK_SIZE_CHANGED, r, releasable=True)
    if proved:
        return Assessment(r, r.num_tokens, True, Reason.FULL_MATCH, True)
    a = agreement(r.chain, r.num_tokens, prompt, block_size, prompt_chain)
    if a.full:
        return Assessment(r, a.tokens, True, Reason.FULL_MATCH, True)
    assert a.diverges_at is not None
    start = a.diverges_at * block_size
    reason = Reason.PROMPT_SHORTER if a.prompt_ended else explain(r, start, echoed, template, block_size)
    return Assessment(r, a.tokens, False, reason, True)


def explain(
    r: ConversationRecord,
    diverge_start: int,
    echoed: EchoedAnswer | None,
    template: TemplateClass,
    block_size: int,
) -> Reason:
    """Why the prompt leaves D's sequence at token ``diverge_start`` (the start of the first differing block)."""
    if template is TemplateClass.DROPS_REASONING and r.had_reasoning:
        return Reason.REASONING_STRIPPED  # the template drops reasoning, possibly of turns before the last one
    if diverge_start + block_size <= r.prompt_tokens or echoed is None:
        return Reason.HISTORY_EDITED  # the difference lies before the last answer
    if echoed.answer_digest != r.answer_digest:
        # an answer that called tools and comes back without calls was rewritten as text (smolagents does)
        return Reason.ANSWER_AS_TEXT if r.answer_calls and not echoed.calls else Reason.ANSWER_EDITED
    if r.had_reasoning and template is TemplateClass.DROPS_REASONING:
        return Reason.REASONING_STRIPPED
    if r.had_reasoning and not echoed.has_reasoning:
        return Reason.REASONING_DROPPED  # the client's doing (LangChain, smolagents), not the template's
    if r.had_reasoning and echoed.reasoning_digest != r.reasoning_digest:
        return Reason.ANSWER_EDITED
    if template is TemplateClass.REWRITES_HISTORY:
        return Reason.HISTORY_EDITED
    return Reason.RETOKENIZED


def unpinned_reason(record: ConversationRecord) -> Reason:
    """Why a record that holds no handle cannot be pulled: D gave none, the policy judged a pull would not
    pay when the answer was captured (its handle was not kept), or the handle was given back for memory."""
    if record.unpinned == "no_handle_in_stream":
        return Reason.NO_HANDLE_IN_STREAM
    if record.unpinned in ("not_needed", "decode_local"):
        return Reason.CHEAPER_TO_RECOMPUTE
    if record.unpinned == "spent":
        return Reason.HANDLE_SPENT
    if record.unpinned == "write_back":
        return Reason.WRITTEN_BACK
    return Reason.PIN_RELEASED
