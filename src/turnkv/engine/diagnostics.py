"""What ``turnkv doctor`` asks of an engine family besides a turn's calls (``base.Engine``), engine-neutral.

An engine says what it is and how it is set up (``describe``): its version, models, KV cache, the
GPUs it computes on, whether it has a tokenizer, and its KV transfer settings where it exposes them
(for those it does not, how an operator can check). It makes token ids from text for the probes'
prompts, reads its own logs (the transports its KV moves over, the settings it logged at start), says
where a handle's blocks are served from, and gives the engine-specific fix for each problem the doctor
can find (``Advice``). The doctor's logic (``turnkv.doctor``) holds no engine's names or flags.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from turnkv.engine.base import Handle, ModelCard


class Advice(enum.StrEnum):
    """The problems whose fix depends on the engine family."""

    NO_CONNECTOR = "no_connector"  # P answered a remote-decode prefill without a handle for D
    BIDIRECTIONAL_OFF_D = "bidirectional_off_d"  # D answered without a handle of its own
    BIDIRECTIONAL_OFF_P = "bidirectional_off_p"  # P did not pull D's blocks
    TRANSFER_FAILED = "transfer_failed"  # the engines could not move KV between them
    NO_TOKENIZER = "no_tokenizer"  # the engine has no tokenizer (cannot render a chat)
    VERSIONS_DIFFER = "versions_differ"
    SLOW_LINK_SAME_HOST = "slow_link_same_host"  # far below what the GPUs' path should do, one host
    SLOW_LINK_HOSTS = "slow_link_hosts"  # far below a network's rate, across hosts
    SAME_SIDE_CHANNEL = "same_side_channel"  # two engines advertise one side-channel address
    SHOW_TRANSPORTS = "show_transports"  # how to make the engine log the transports its KV moves over


@dataclass(frozen=True)
class TransferSettings:
    """An engine's KV transfer settings, each None where it does not say."""

    connector: str | None = None  # "" when it runs none
    role: str | None = None
    bidirectional: bool | None = None
    recompute_threshold: int | None = None
    decoder_ttl_s: float | None = None
    lease_s: float | None = None
    failure_policy: str | None = None
    side_channel: str | None = None  # host:port its blocks are served from
    buffer_device: str | None = None


@dataclass(frozen=True)
class EngineDescription:
    """What an engine says about itself. ``transfer`` None: it does not expose its transfer settings;
    ``unexposed`` then names each setting it keeps to itself and how an operator can check it."""

    version: str | None
    plugin: str | None  # turnkv's plugin in the engine, by its version; None: not installed
    gpus: frozenset[str]  # the GPUs it computes on (empty: not said)
    models: tuple[ModelCard, ...]
    block_size: int | None
    num_blocks: int | None
    prefix_caching: bool | None
    memory_share: float | None  # share of its GPUs' memory it was given
    tokenizer: bool | None  # it can tokenize (False: tokens only; None: could not tell)
    tokenizer_detail: str
    takes_prompt_ids: bool  # a decode request may carry the prompt as token ids
    stream_handles: bool | None  # its streams end with D's handle (None: not known until seen)
    transfer: TransferSettings | None
    unexposed: tuple[tuple[str, str], ...] = ()  # (setting, how to check it)

    @property
    def capacity_tokens(self) -> int | None:
        if self.block_size is None or self.num_blocks is None:
            return None
        return self.block_size * self.num_blocks


@dataclass(frozen=True)
class TransferTotals:
    """An engine's running totals of the KV transfers it read (its reads of another engine's blocks)."""

    count: float
    bytes: float
    seconds: float
    failed: float  # transfers that failed


@dataclass(frozen=True)
class LogFacts:
    """What an engine's log says that its API does not."""

    transports: frozenset[str] = frozenset()  # the transports its KV transfers were set up over
    remote_access: frozenset[str] = frozenset()  # those that serve remote reads and writes
    emulated: bool = False  # remote reads run as messages over another transport (no zero-copy path)
    transfer_lines: tuple[str, ...] = ()  # its own transfer statistics lines, last few
    settings: dict[str, str] = field(default_factory=dict)  # settings it logged at start


class EngineDiagnostics(Protocol):
    """The calls ``turnkv doctor`` makes of an engine family beside ``base.Engine``'s."""

    async def describe(self, base: str) -> EngineDescription | None:
        """None when the engine cannot be reached."""

    async def transfers(self, base: str) -> TransferTotals | None:
        """Its transfer totals now; None when it cannot be read."""

    async def tokenize(self, base: str, text: str, model: str | None) -> list[int]:
        """Token ids of ``text`` (raises ``UpstreamError`` where the engine cannot)."""

    def handle_endpoint(self, handle: Handle) -> str | None:
        """Where the blocks a handle names are served from (host:port), when it says."""

    def read_log(self, text: str) -> LogFacts: ...

    def advice(self, topic: Advice) -> str: ...
