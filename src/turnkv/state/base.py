"""The conversation store contract, in three parts: ``Records`` (claim a record once, put the next
one), the ``PinIndex`` (the decode KV that stored handles pin, per decode engine, so that it can be held
within a budget) and ``Documents`` (the Responses API's stored objects). ``ConversationStore`` is the
three on one backing store, implemented in memory (``state.memory``) and on Redis (``state.redis``).

``claim`` is atomic: of two turns racing on one conversation, one gets the record and the other
sees ``in_flight``. A pool (``pool``: a base key and its slots) holds several interchangeable records under
one name, for conversations found from their history, which several clients may share word for word:
``claim_any`` takes one of them (the one whose answer the client echoes, where it can tell), ``put_any``
adds one beside the others. A claimed key holds the claiming turn's in-flight marker until ``put`` replaces
it or ``release`` (by that owner) drops it, or it times out.

The pin index: a stored record whose ``handle`` is set pins ``num_tokens`` of KV on its decode
engine until a turn claims it (the turn then owns the handle: it pulls it or releases it), the
store evicts it, or it expires. ``evict`` takes pins off one engine, idle longest first among the tenants
holding more than their share of what stays (``state.fair``), and leaves
their records without a handle (``unpinned`` says why), so no turn can use a handle that is being
released; it returns the entries whose handles the caller must release at the engine, and never
one whose record a turn claimed meanwhile (that turn owns the handle).

Every operation touches the keys of one Redis Cluster hash slot at a time: a conversation's keys
share its slot, each engine's index its own. Implementations raise ``StoreError`` on any failure.

``Nodes``: which node of the backing store serves a key. A node fails on its own and the guard
(``state.guard``) keeps a breaker per node, so that one Redis Cluster master's outage costs only the
conversations it serves. A store on one server (memory, one Redis, Sentinel's master) is one node.
An operation runs on the node of its key (a conversation's, a document's, an engine's index); a step
it takes on another node (a put's pin entry on its engine's index) goes through that node's breaker
as well (``ConversationStore.steps_through``) and costs the operation nothing when it fails.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from turnkv.state.record import ConversationRecord

IN_FLIGHT_TTL_S = 300.0
T = TypeVar("T")
POOL_SLOTS = 8  # records a pool holds (identical conversations that run at once)
SLOT = "#"  # a pool's keys: its base key, then base#1 ... (one Redis Cluster hash slot: the base is the tag)


def base_of(key: str) -> str:
    """The pool a key is a slot of (a key that is no slot: itself)."""
    return key.partition(SLOT)[0]


def pool(key: str, slots: int = POOL_SLOTS) -> list[str]:
    """The keys of the pool based on ``key``: ``key`` itself (where a record stored before pools were is
    found), then ``key#1`` ... ``key#{slots-1}``."""
    return [key, *(f"{key}{SLOT}{i}" for i in range(1, slots))]


class ClaimStatus(enum.Enum):
    FOUND = "found"
    MISSING = "missing"
    IN_FLIGHT = "in_flight"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class Claim:
    status: ClaimStatus
    record: ConversationRecord | None = None


@dataclass(frozen=True)
class Pinned:
    """Live handles on one decode engine: how many and how many tokens of KV they pin."""

    handles: int
    tokens: int


@dataclass(frozen=True)
class PinEntry:
    """One stored handle in the pin index of its decode engine."""

    key: str  # the conversation's store key
    decode_url: str
    tokens: int
    handle: dict[str, Any]  # D's handle: what a release sends back
    pin_id: str  # the handle's pin id (``ConversationRecord.pin_id``): which pin of the conversation it is
    stored_at: float  # wall clock; idle since then
    expires_at: float  # wall clock; past it the handle is not used (D frees it soon after)
    engine_epoch: float | None  # the engine's process start time when it made the handle
    tenant: str = ""  # whose conversation it is ("": an entry written before entries said)


class Records(Protocol):
    """Conversation records: claimed once by a turn, put by the turn that answered."""

    async def claim(self, key: str, *, owner: str) -> Claim:
        """Take the record (single use) and leave ``owner``'s in-flight marker; drops its pin entry."""

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        """Store the next record (replacing any marker) and, when it holds a handle, index its pin."""

    async def release(self, key: str, *, owner: str) -> None:
        """Drop ``owner``'s in-flight marker (a turn that stores nothing); anything else stays."""

    async def claim_any(self, keys: Sequence[str], *, owner: str, prefer: str | None = None) -> tuple[str, Claim]:
        """A pool of interchangeable records (``pool``): claim, as ``claim`` does, the first of ``keys`` whose
        record's ``answer_digest`` is ``prefer``, else the first holding a record. Returns the key claimed
        and the claim; when none holds an unclaimed record, the first key and ``IN_FLIGHT`` (some are
        claimed) or ``MISSING``."""

    async def put_any(
        self, keys: Sequence[str], record: ConversationRecord, ttl_s: float, *, owner: str
    ) -> tuple[str, ConversationRecord | None]:
        """Store ``record`` in a pool: in the first of ``keys`` holding nothing or ``owner``'s own marker,
        else over the first holding an unclaimed record, else over the first. Returns the key used and the
        unclaimed record it replaced (a full pool), whose handle nobody will claim now: the caller releases
        it."""


class PinIndex(Protocol):
    """The decode KV that stored handles pin, per decode engine, kept within a budget."""

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        """What the index holds per engine (engines with nothing pinned are absent)."""

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        """Take pins off ``decode_url`` until at most ``keep_tokens`` stay pinned, in ``fair_evictions``'
        order: idle longest first among the tenants holding more than an equal share of ``keep_tokens``,
        so no tenant's pins go below its share for another's; their records lose the handle
        (``unpinned = why``). Returns the entries to release."""

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        """Drop index entries that no longer pin anything: past ``expires_at``, of an engine epoch other
        than ``epoch`` (when given: a restart freed them), or whose record is gone or holds another
        handle. Returns them (nothing to release: the engine freed or will free them itself)."""


class Documents(Protocol):
    """Small documents with a TTL (the stored Responses API objects)."""

    async def put(self, key: str, value: str, ttl_s: float) -> None: ...

    async def get(self, key: str) -> str | None: ...

    async def delete(self, key: str) -> bool:
        """Drop the document; whether there was one."""
        ...


class Nodes(Protocol):
    """Which node of the backing store serves a key, as far as the store knows now."""

    def of_conversation(self, key: str) -> str: ...

    def of_document(self, key: str) -> str: ...

    def of_index(self, decode_url: str) -> str: ...

    def serving(self) -> frozenset[str]:
        """The nodes that serve keys now (a Cluster's masters); a node not among them serves none."""

    async def refresh(self) -> None:
        """Learn again which node serves what (a Cluster's slots after a failover). Raises ``StoreError``."""


class OneNode:
    """``Nodes`` of a store on one server: every key on the node ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._serving = frozenset({name})

    def of_conversation(self, key: str) -> str:
        return self.name

    def of_document(self, key: str) -> str:
        return self.name

    def of_index(self, decode_url: str) -> str:
        return self.name

    def serving(self) -> frozenset[str]:
        return self._serving

    async def refresh(self) -> None:
        return None


class Gate(Protocol):
    """A step on one node of the store, through that node's breaker: raises ``StoreError`` (kind ``open``)
    at once while the node counts as down, else runs ``fn`` and reports how it went."""

    def __call__(self, node: str, op: str, fn: Callable[[], Awaitable[T]]) -> Awaitable[T]: ...


class ConversationStore(Protocol):
    """The three parts, on one backing store (their records and pins are written together: a put indexes
    its pin, a claim and an evict take it out)."""

    @property
    def nodes(self) -> Nodes: ...

    def steps_through(self, gate: Gate) -> None:
        """Run each step of an operation that falls on another node than the operation's through ``gate``
        (a store on one node has no such steps)."""

    @property
    def records(self) -> Records: ...

    @property
    def pins(self) -> PinIndex: ...

    @property
    def documents(self) -> Documents: ...

    async def ping(self, node: str | None = None) -> None:
        """PING the store (``node``: that node only, once, as the guard's prober asks while its breaker
        is open). Raises ``StoreError``."""

    async def close(self) -> None: ...
