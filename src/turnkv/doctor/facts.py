"""What the doctor observed, before any judgement: the engines as they describe themselves, the chat
template, the transfers it measured, and the host it runs on."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from turnkv.engine.diagnostics import EngineDescription, LogFacts
from turnkv.reuse.assess import TemplateClass


@dataclass(frozen=True)
class EngineFacts:
    url: str
    role: str  # prefill | decode | render
    description: EngineDescription | None  # None: unreachable
    log: LogFacts | None = None  # from --log, when given
    local: bool = False  # its host is this machine

    @property
    def models(self) -> frozenset[str]:
        d = self.description
        return frozenset(m.name for m in d.models) if d is not None else frozenset()

    @property
    def max_model_len(self) -> int | None:
        d = self.description
        lens = [m.max_model_len for m in d.models if m.max_model_len] if d is not None else []
        return min(lens) if lens else None


@dataclass(frozen=True)
class TemplateFacts:
    """The chat template as the gateway's render target renders it."""

    target: str  # the URL audited
    configured: bool  # the gateway's render setting names it (else: the first prefill engine)
    cls: TemplateClass | None  # None: not audited (the target cannot render)
    detail: str
    tools: bool = True  # audited with the tool-call probe (False: the template refused tools)
    decode_agrees: bool | None = None  # D renders the probe to the same ids (None: not compared)


@dataclass(frozen=True)
class Sample:
    """Transfers the reading engine counted between two readings of its metrics: one, unless live
    traffic moved KV meanwhile (then their mean)."""

    tokens: int  # the probe's tokens
    bytes: float
    seconds: float
    count: float

    @property
    def mean_bytes(self) -> float:
        return self.bytes / self.count

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.count

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


class PullOutcome(enum.StrEnum):
    DONE = "done"  # P read D's blocks
    NOT_TRIED = "not_tried"  # no handle from D, or nothing to measure
    REFUSED = "refused"  # P answered an error without a failed transfer: it does not take D's handles
    STALLED = "stalled"  # P did not answer before the deadline: it waits for a read it never starts
    FAILED = "failed"  # P tried and the transfer failed


@dataclass(frozen=True)
class SizeRun:
    """One probe size: a plain P/D turn (P prefills cold, D reads P's KV) and a pull (P reads D's)."""

    tokens: int
    prefill_s: float | None = None  # P's cold prefill, the whole call
    push: Sample | None = None  # P -> D, as D counted it
    pull: Sample | None = None  # D -> P, as P counted it
    pull_call_s: float | None = None  # P's call that pulled, the whole call
    error: str | None = None


@dataclass(frozen=True)
class Load:
    """What the probes cost the engines."""

    prefill_requests: int = 0
    decode_requests: int = 0
    prefilled_tokens: int = 0
    moved_bytes: float = 0.0
    seconds: float = 0.0
    released: int = 0  # handles the probes got from D and gave back
    left_pinned: int = 0  # handles they could not give back (D frees them at its TTL)


@dataclass(frozen=True)
class TransferFacts:
    prefill: str
    decode: str
    block_size: int
    runs: tuple[SizeRun, ...] = ()
    p_hands_off: bool | None = None  # P returned what D needs (None: never got that far)
    d_handle: bool | None = None  # D returned its own handle
    pull: PullOutcome = PullOutcome.NOT_TRIED
    pull_detail: str = ""
    push_failed: str | None = None  # D could not read P's KV
    p_endpoint: str | None = None  # where P serves its blocks (its handles say)
    d_endpoint: str | None = None
    skipped: tuple[str, ...] = ()  # sizes not run, and why
    load: Load = field(default_factory=Load)


@dataclass(frozen=True)
class HostFacts:
    """What this machine can tell about the GPUs' paths (engines on it only)."""

    nvidia_smi: bool = False
    uuids: dict[str, int] = field(default_factory=dict)  # GPU UUID -> index
    p2p: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j) -> "OK", "NS", ...
    topology: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j) -> "NV18", "PIX", "SYS", ...
    rdma: tuple[str, ...] = ()  # RDMA devices (/sys/class/infiniband)
    detail: str = ""
