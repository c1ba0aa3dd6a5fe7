"""What each step of a turn decided, as frozen values: the driver passes them on, nothing edits them.

``Claimed`` (CLAIM: the conversation's record, taken for this turn), ``Rendered`` (RENDER: the prompt's token
ids), ``Plan`` (PLAN, or SHORTCUT without a render: how the turn runs and why; ``Plan.downgrade`` and
``Plan.checked`` are the only ways it changes once made), ``Prefilled`` (PREFILL: P's params for D),
``Opened`` (DECODE: D's answer, open), ``AfterTurn`` (what becomes of D's new handle: the planner decides,
CAPTURE does it), ``Capture`` (CAPTURE: what the turn left for the next one), and ``Fallback`` (why a plan
became plain P/D).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from turnkv.engine.base import Collected, DecodeAnswer, DecodeStream, Handle, HandleUse, PrefillResult
from turnkv.gateway.fleet import Slot
from turnkv.gateway.turn.deadline import Deadline
from turnkv.reuse.assess import Assessment, Reason
from turnkv.reuse.chain import ChainBuilder
from turnkv.reuse.cost import Action
from turnkv.state.base import Claim, ClaimStatus
from turnkv.state.record import ConversationRecord


class Ahead(enum.StrEnum):
    """How a turn planned from the record before its render (the SHORTCUT step) stands to the render."""

    CHECKED = "checked"  # P pulls before the token check; the check (``turn.ahead``) gates D
    SKIPPED = "skipped"  # nothing of D's KV is reused unchecked (recompute), or the policy checks no tokens


@dataclass(frozen=True)
class Claimed:
    """The conversation's record, claimed for this turn (single use), or why there is none."""

    claim: Claim | None = None  # None: nothing claimed (no conversation) or the store failed
    # why the turn reuses nothing as far as the claim can tell: no_session once claimed (PLAN says why, from
    # the record); store_busy or store_unavailable when the store did not answer
    reason: Reason = Reason.NO_SESSION
    seconds: float = 0.0
    key: str | None = None  # the store key claimed (of a pool: the slot), where CAPTURE puts back or releases

    @property
    def record(self) -> ConversationRecord | None:
        """The claimed record, when there was one to claim."""
        c = self.claim
        return c.record if c is not None and c.status is ClaimStatus.FOUND else None

    @property
    def held(self) -> bool:
        """The store holds this turn's in-flight marker (CAPTURE gives it back)."""
        return self.claim is not None and self.claim.status in (ClaimStatus.FOUND, ClaimStatus.CORRUPT)


@dataclass(frozen=True)
class Rendered:
    """The prompt as the engines will see it (None: not rendered), or why the render gave nothing."""

    prompt_ids: Sequence[int] | None = None
    chain: ChainBuilder | None = None  # the hash chain of ``prompt_ids``, when it was needed before D
    proved: bool = False  # ``prompt_ids`` start with the claimed record's whole sequence (``chain.proves``)
    seconds: float = 0.0  # the render call (beside the claim, where they ran at once: both)
    reason: Reason | None = None  # render_failed or request_rejected: why there are no ids to check
    failure: BaseException | None = None  # the turn cannot go on: the client gets this error


# why a turn that runs as plain P/D after all reports what it reports (``Plan.downgrade``)
_FALLBACK_REASON = {
    ("prefill", "pull_failed"): Reason.PULL_FAILED,
    ("prefill", "first_token_deadline"): Reason.FIRST_TOKEN_DEADLINE,
    ("decode", "decode_failed"): Reason.DECODE_FAILED,
    ("decode", "first_token_deadline"): Reason.FIRST_TOKEN_DEADLINE,
}


class Fallback(enum.Enum):
    """Why a planned turn runs as plain P/D without the stored handle after all (``Plan.downgrade``)."""

    PULL_FAILED = ("prefill", "pull_failed")  # P could not pull D's blocks
    PREFILL_DEADLINE = ("prefill", "first_token_deadline")  # P stalled past its deadline on a handle
    DECODE_FAILED = ("decode", "decode_failed")  # D failed before its first token
    DECODE_DEADLINE = ("decode", "first_token_deadline")  # D missed its first-token deadline
    DECODE_LOCAL_FAILED = ("decode", "decode_local_failed")  # the D holding the conversation failed
    RENDER_MISMATCH = ("prefill", "render_mismatch")  # the check did not prove what P pulled ahead of it

    @property
    def leg(self) -> str:
        return self.value[0]

    @property
    def why(self) -> str:
        return self.value[1]


@dataclass(frozen=True)
class Plan:
    """How the turn runs: the action, why, on which engines, and what P gets of the stored handle.

    Made once (``turn.plan``); after that it changes only by its own methods: ``downgrade`` (the turn runs
    as plain P/D after all) and ``checked`` (the token check of a turn planned ahead of it has run)."""

    action: Action
    reason: Reason
    prefill_url: str | None = None
    decode_url: str | None = None
    send: HandleUse | None = None  # the stored handle for P: pulled (trimmed to what matches) or released
    pull_tokens: int = 0  # tokens P is expected to pull (what D has beyond P's own cache)
    expected_cached: int = 0  # prompt tokens the engines should not have to compute
    planned_tokens: int = 0  # the prompt's length as estimated by a plan made without a render; 0: rendered
    local_new_tokens: int = 0  # decode-local: the tokens D prefills itself (its chunks share D's steps)
    estimates: Mapping[str, float] = field(default_factory=dict)  # the policy's TTFT estimates, ms
    charges: Mapping[str, float] = field(default_factory=dict)  # ... P's compute x the turns behind it, ms
    load: Mapping[str, object] = field(default_factory=dict)  # the engines' load it was told (``reuse.load``)
    assessment: Assessment | None = None
    direct: bool = False  # decode-local without a render
    expect_hits: int = 0  # tokens P should find in its prefix cache (for the cache-factor measurement)
    ahead: Ahead | None = None  # planned from the record, P sent the messages before the render returned

    @classmethod
    def plain(cls, reason: Reason) -> Plan:
        """Plain P/D with the client's request, for ``reason``: nothing stored is used, and the legs pick
        the engines."""
        return cls(Action.RECOMPUTE, reason)

    @property
    def pulls_ahead(self) -> bool:
        """P pulls D's blocks with the messages, sent before the token check ran (its request is salted
        apart; D starts only once the check has proved them)."""
        return self.ahead is Ahead.CHECKED and self.send is not None and self.send.tokens > 0

    @property
    def decode_local(self) -> bool:
        return self.action is Action.DECODE_LOCAL

    def outcome(self, stateful: bool) -> str:
        """What became of the conversation's KV: full, partial, none, decode_local, or stateless (a turn on
        the KV written back to P counts as a pull would)."""
        if self.action is Action.DECODE_LOCAL:
            return "decode_local"
        if self.action is Action.PULL and self.assessment is not None:
            return self.assessment.outcome
        if self.from_write_back:
            return self.assessment.outcome if self.assessment is not None else "full"
        return "none" if stateful else "stateless"

    @property
    def from_write_back(self) -> bool:
        """P computes the turn on the conversation's KV that D wrote back to it after the last turn: what
        matched of D's sequence comes from P's prefix cache, as a pull's would. ``written_back`` says the
        whole sequence matched (proved by the record or by the token check); P is the one written to where
        it is expected to cache some of it."""
        if self.action is not Action.RECOMPUTE:
            return False
        if self.reason is Reason.WRITTEN_BACK:
            return self.expected_cached > 0
        a = self.assessment
        return (
            a is not None
            and a.record is not None
            and a.record.unpinned == "write_back"
            and a.record.prefill_url == self.prefill_url
        )

    def downgrade(self, why: Fallback | Reason, *, stateful: bool = True, release: Handle | None = None) -> Plan:
        """The plan run as plain P/D after all: P computes what its own cache lacks, pulls nothing (it gets
        ``release`` to free, if any), and D continues from P's KV.

        The reason it then gives: ``why`` itself where it is a reason (the turn cannot go on: the client
        hears why). For a ``Fallback``: a failed or stalled pull reports it only when a pull was planned (a
        handle sent only to be released cost the turn nothing); a decode leg that failed before its first
        token reports it whenever the turn belonged to a conversation (``stateful``: what it planned did
        not happen); a decode-local turn whose D failed keeps its reason; a pull the check did not prove
        says what the check found."""
        action = Action.RECOMPUTE if self.action in (Action.PULL, Action.DECODE_LOCAL) else self.action
        return replace(
            self,
            action=action,
            reason=why if isinstance(why, Reason) else self._reason_after(why, stateful=stateful),
            send=HandleUse.release(release) if release is not None else None,
            pull_tokens=0,
            expected_cached=0,
            direct=False,
        )

    def _reason_after(self, why: Fallback, *, stateful: bool) -> Reason:
        if why is Fallback.DECODE_LOCAL_FAILED:
            return self.reason
        if why is Fallback.RENDER_MISMATCH:  # what the check found, or that there was nothing to check
            return self.assessment.reason if self.assessment is not None else Reason.RENDER_FAILED
        if why.leg == "prefill":
            return _FALLBACK_REASON[why.value] if self.action is Action.PULL else self.reason
        return _FALLBACK_REASON[why.value] if stateful else self.reason

    def checked(self, found: Assessment) -> Plan:
        """The plan of a turn planned ahead of its render, once the token check has run: it keeps what the
        check found, and gives the check's reason unless the policy's own stands."""
        return replace(self, assessment=found, reason=found.reason if self.reason is Reason.FULL_MATCH else self.reason)


@dataclass(frozen=True)
class Prefilled:
    url: str
    seconds: float  # the call's wall time, P's queue included
    result: PrefillResult
    served_s: float | None = None  # P's time on it, its wait behind this gateway's earlier prefills left out


@dataclass(frozen=True)
class Opened:
    """D's answer, opened: a stream the relay reads, or a whole JSON answer."""

    url: str
    slot: Slot  # D's in-flight count, held until the answer is closed
    deadline: Deadline  # for a stream's first output (renewed while D is busy)
    sent: float  # loop time the request went out: the deadline counts from it
    stream: DecodeStream | None = None
    answer: DecodeAnswer | None = None

    @property
    def collected(self) -> Collected:
        if self.stream is not None:
            return self.stream.collected
        assert self.answer is not None, "an opened answer is a stream or a body"
        return self.answer.collected


class AfterTurn(enum.StrEnum):
    """What becomes of a turn's new handle once the turn is answered: the planner decides
    (``plan.after_turn``), CAPTURE does it. The value is what the record then says of it
    (``ConversationRecord.unpinned``) where it is let go."""

    PIN = "pinned"  # kept pinned on D: a pull would use it on a next turn like this one
    # ... kept as a hedge: a pull beats P recomputing the history, should D not take the next turn
    HEDGE = "hedge"
    LET_GO = "not_needed"  # left to D's prefix cache: no pull would use it (D's TTL, within the unused share)
    DECODE_CROWDED = "decode_crowded"  # released at once: requests wait on D for blocks its pins hold
    # handed to P's prefix cache (``gateway.writeback``): D's pin freed once P has pulled the blocks
    WRITE_BACK = "write_back"

    @property
    def kept(self) -> bool:
        return self in (AfterTurn.PIN, AfterTurn.HEDGE)


class Capture(enum.StrEnum):
    """What a turn left for the next one (the value is what logs and metrics say)."""

    STORED = "stored"  # the next record, with D's new handle kept pinned (the policy would pull it)
    # ... kept as a hedge: a pull beats P recomputing the history, should D not take the next turn
    STORED_HEDGE = "stored_hedge"
    STORED_NOT_NEEDED = "stored_not_needed"  # ... its handle released: a pull would not pay
    STORED_DECODE_CROWDED = "stored_decode_crowded"  # ... its handle released at once: turns wait on D
    STORED_WRITE_BACK = "stored_write_back"  # ... its handle written back to P's prefix cache
    STORED_DECODE_LOCAL = "stored_decode_local"  # ... D was asked for no handle (decode-local)
    STORED_NO_HANDLE_IN_STREAM = "stored_no_handle_in_stream"  # ... D's stream carried none
    NO_SESSION = "no_session"  # a stateless turn
    FAILED = "failed"  # the turn failed
    NO_TOKEN_IDS = "no_token_ids"  # D did not say its prompt's token ids
    NO_HANDLE = "no_handle"  # D returned no handle where it should have
    NOT_A_DECODE_HANDLE = "not_a_decode_handle"
    INCONSISTENT_HANDLE = "inconsistent_handle"  # the handle does not fit the tokens D computed
    INCOMPLETE_HANDLE = "incomplete_handle"  # the handle does not say where its blocks are
    STORE_UNAVAILABLE = "store_unavailable"
    # nothing new was stored, and the turn had not used the claimed record: it was put back
    FAILED_KEPT_PREVIOUS = "failed_kept_previous"
    NO_TOKEN_IDS_KEPT_PREVIOUS = "no_token_ids_kept_previous"
    NO_HANDLE_KEPT_PREVIOUS = "no_handle_kept_previous"
    NOT_A_DECODE_HANDLE_KEPT_PREVIOUS = "not_a_decode_handle_kept_previous"
    INCONSISTENT_HANDLE_KEPT_PREVIOUS = "inconsistent_handle_kept_previous"
    INCOMPLETE_HANDLE_KEPT_PREVIOUS = "incomplete_handle_kept_previous"
    # nothing new was stored, and P had taken the claimed record's handle: the record was put back without it
    FAILED_KEPT_UNPINNED = "failed_kept_unpinned"
    NO_TOKEN_IDS_KEPT_UNPINNED = "no_token_ids_kept_unpinned"
    NO_HANDLE_KEPT_UNPINNED = "no_handle_kept_unpinned"
    NOT_A_DECODE_HANDLE_KEPT_UNPINNED = "not_a_decode_handle_kept_unpinned"
    INCONSISTENT_HANDLE_KEPT_UNPINNED = "inconsistent_handle_kept_unpinned"
    INCOMPLETE_HANDLE_KEPT_UNPINNED = "incomplete_handle_kept_unpinned"

    @property
    def stored(self) -> bool:
        """A next record was stored (whether or not it holds a handle)."""
        return self in _STORED

    def kept_previous(self) -> Capture:
        return Capture(f"{self.value}_kept_previous")

    def kept_unpinned(self) -> Capture:
        return Capture(f"{self.value}_kept_unpinned")

    @property
    def put_back(self) -> bool:
        """Nothing new was stored, and the claimed record was put back (as it was, or without the handle P
        took)."""
        return self.value.endswith(("_kept_previous", "_kept_unpinned"))

    @classmethod
    def unpinned(cls, why: str) -> Capture:
        """A record stored without a handle, for ``why`` (``ConversationRecord.unpinned``)."""
        return cls(f"stored_{why}")


_STORED = frozenset(
    {
        Capture.STORED,
        Capture.STORED_HEDGE,
        Capture.STORED_NOT_NEEDED,
        Capture.STORED_DECODE_CROWDED,
        Capture.STORED_WRITE_BACK,
        Capture.STORED_DECODE_LOCAL,
        Capture.STORED_NO_HANDLE_IN_STREAM,
    }
)
