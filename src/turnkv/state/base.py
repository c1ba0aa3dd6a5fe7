"""The conversation store contract: claim a record once, put the next one, report what is pinned.

``claim`` is atomic: of two turns racing on one conversation, one gets the record and the other
sees ``in_flight``. A claimed key holds an in-flight marker until ``put`` replaces it or
``release`` drops it (or it times out). Implementations raise ``StoreError`` on any failure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from turnkv.state.record import ConversationRecord

IN_FLIGHT_TTL_S = 300.0


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


class ConversationStore(Protocol):
    async def claim(self, key: str) -> Claim: ...

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None: ...

    async def release(self, key: str) -> None: ...

    async def pinned(self, now: float) -> dict[str, Pinned]: ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...
