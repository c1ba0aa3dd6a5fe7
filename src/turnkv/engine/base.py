"""The engine seam: what turnkv asks of an inference engine, and nothing of how it is asked.

One ``Engine`` serves every instance of one engine family, as an httpx transport serves every
request of its client: calls name the instance by its base URL. The turn pipeline, the fleet
(health and load) and the releaser speak only this protocol, in four parts by concern (``TurnCalls``,
``HandleRules``, ``EngineProbes``, ``PassThrough``). Everything about one engine's wire protocol lives
behind it: field names, which request fields a client may not send, how a KV handle is trimmed for a
pull or turned into a release, where a stream carries D's handle, which versions do what
(``engine.vllm``). ``engine.mock`` is a double driven by a handler function, for tests.

Errors: calls raise the ``turnkv.errors.UpstreamError`` tree, translated once at the engine's own
boundary, naming the leg (render, prefill, decode, probe) and the instance. A stream that breaks
while it is read raises ``StreamBroken``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnkv.errors import UpstreamStatus
from turnkv.openai.answer import AnswerAccumulator
from turnkv.openai.sse import frame

# An engine's KV handle (vLLM: D's ``kv_transfer_params``): opaque outside the engine that made it,
# stored verbatim with the conversation and handed back to the same engine family.
Handle = dict[str, Any]
# One SSE event of a decode answer as the relay sees it: the payload to forward (None: nothing a client
# of the plain engine would have got), whether it shows the client output, and whether the engine has
# reported an error by this event.
Piece = tuple[bytes | None, bool, bool]


class StreamBroken(Exception):
    """The decode stream failed while it was read (connection reset, read timeout)."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class HandleProblem(enum.StrEnum):
    """Why a handle an engine returned cannot be stored for the next turn."""

    NOT_A_DECODE_HANDLE = "not_a_decode_handle"
    INCONSISTENT = "inconsistent_handle"
    INCOMPLETE = "incomplete_handle"


@dataclass(frozen=True)
class HandleFacts:
    """What turnkv needs to know about a handle it may keep."""

    tokens: int  # tokens of KV the handle's blocks hold on D
    engine_id: str  # the engine that holds them


@dataclass(frozen=True)
class CallMeta:
    """Who an engine call is for: the request id it is logged under, and the client's credentials, passed
    on when the gateway has none of its own for the engines."""

    request_id: str | None = None
    authorization: str | None = None


@dataclass(frozen=True)
class HandleUse:
    """A stored handle as a prefill engine gets it: pull D's first ``tokens`` tokens of KV, or, with 0,
    nothing: P then only tells D to free the blocks (a release on the way)."""

    handle: Handle
    tokens: int

    @classmethod
    def release(cls, handle: Handle) -> HandleUse:
        return cls(handle, 0)


@dataclass(frozen=True)
class PrefillCall:
    """One prefill: the prompt as token ids (rendered) or, when there are none, as the client's request."""

    path: str  # the client's endpoint, for a prompt sent as the client's request
    body: Mapping[str, Any]  # the client's request as the engines get it
    prompt_ids: Sequence[int] | None
    handle: HandleUse | None
    timeout_s: float  # the whole call, a pull included
    return_ids: bool = False  # P is to say the prompt's token ids it computed from (``PrefillResult.prompt_ids``)


@dataclass(frozen=True)
class WriteBack:
    """A finished turn's KV handed from D to a prefill engine's prefix cache: P pulls the blocks ``handle``
    pins on D for ``token_ids`` (the sequence the handle holds: the turn's prompt and D's answer) into its
    own prefix cache, keyed by those ids and evictable as any other, and D frees them. A next turn that
    extends the sequence then finds it at P, with nothing pinned anywhere meanwhile."""

    handle: Handle
    token_ids: Sequence[int]
    model: str | None
    timeout_s: float  # until P has pulled the blocks (its first output)
    priority: int | None = None  # the engine's request priority, where it schedules by priority (None: none sent)
    release_via: str | None = None  # an engine that can read P's blocks, to release a pin P kept (D)


class WriteBackResult(enum.StrEnum):
    """What a write-back left on the prefill engine."""

    CACHED = "cached"  # the blocks are in P's prefix cache, evictable; D freed them
    # ... but P finished the request before the gateway's abort reached it: P holds them pinned as D did (vLLM
    # pins a finished request's blocks that came with D's handle, for decoder_kv_blocks_ttl)
    PINNED = "pinned"
    RELEASED = "released"  # ... and that pin was released through ``WriteBack.release_via`` (P's handle seen)


@dataclass(frozen=True)
class PrefillResult:
    for_decode: Handle | None  # what D needs to take P's KV over (vLLM: P's kv_transfer_params)
    cached_tokens: int | None  # prompt tokens P did not compute (its prefix cache and the pull)
    prompt_tokens: int | None  # the prompt's length as P counted it
    prompt_ids: list[int] | None = None  # the ids P computed from, when asked (``return_ids``) and it said


@dataclass(frozen=True)
class DecodeCall:
    """One decode: the client's request, continued from P's KV (``for_decode``) or, without it, computed by
    D itself (decode-local; D then pins nothing for a next turn)."""

    path: str
    body: Mapping[str, Any]
    stream: bool
    track: bool  # a conversation's turn: collect D's prompt and generated ids and its handle
    for_decode: Handle | None
    prompt_ids: Sequence[int] | None  # the prompt, for an engine that takes it as ids (``EngineInfo``)
    keep_token_ids: bool  # the client asked for token ids itself: do not hide them
    cached_tokens: int | None  # what the client's usage says of cached prompt tokens (None: D's own figure)


class Collected(Protocol):
    """What a decode answer showed, collected while it is relayed: what the next turn is built from."""

    token_ids: list[int]
    finish_reason: str | None
    error: dict[str, Any] | None
    answer: AnswerAccumulator

    @property
    def prompt_token_ids(self) -> list[int] | None: ...

    @property
    def handle(self) -> Handle | None: ...


@dataclass
class Gathered:
    """A ``Collected`` an engine fills in as it reads an answer (or its own kind of one)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    answer: AnswerAccumulator = field(default_factory=AnswerAccumulator)
    prompt_token_ids: list[int] | None = None
    handle: Handle | None = None


@dataclass
class NothingCollected:
    """What a turn holds before any decode answer was read."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    answer: AnswerAccumulator = field(default_factory=AnswerAccumulator)
    prompt_token_ids: None = None
    handle: None = None


def framed(pieces: Sequence[Piece]) -> bytes:
    """What the client gets of a read's pieces: each forwarded body SSE-framed, in one buffer."""
    return b"".join(frame(body) for body, _, _ in pieces if body is not None)


class DecodeStream(abc.ABC):
    """An open streamed answer, read one network read at a time (so back-pressure reaches the engine)."""

    done: bool = False  # the engine's end marker was read
    closed: bool = False  # given up (``close`` or ``abort``)

    @property
    @abc.abstractmethod
    def collected(self) -> Collected: ...

    @abc.abstractmethod
    async def read(self) -> list[Piece] | None:
        """The events of the next read, up to the end marker; None at the end (raises ``StreamBroken``)."""

    async def read_relayed(self) -> bytes | None:
        """The events of the next read as the client gets them, SSE-framed (b"" when the read held none to
        forward), for the relay after the first output; None at the end (raises ``StreamBroken``). What it
        collects is what ``read`` collects; an engine may skip parsing what needs none."""
        pieces = await self.read()
        return None if pieces is None else framed(pieces)

    @abc.abstractmethod
    async def drain(self, timeout_s: float) -> None:
        """After the end marker: read the rest, so the connection can be reused (bounded, never raises)."""

    @abc.abstractmethod
    async def salvage(self, timeout_s: float) -> None:
        """The client left: read what the engine already sent, collecting it (bounded, never raises), so a
        handle on the final event is not lost."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give the answer up: back to the pool when read to its end, else closed (the engine aborts it)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close it now; the engine aborts the request."""


@dataclass(frozen=True)
class DecodeAnswer:
    """A non-streamed answer, read whole."""

    body: dict[str, Any]  # as the client gets it (what turnkv added to the request removed)
    collected: Collected


@dataclass(frozen=True)
class EngineInfo:
    """What an engine said about itself (its version), and what that means for turnkv."""

    version: str | None
    stream_handles: bool | None  # its streams end with D's handle (None: not known until seen)
    takes_prompt_ids: bool  # a decode request may carry the prompt as token ids
    gpus: frozenset[str] = frozenset()  # the GPUs it computes on, by NVML UUID (empty: not known)


@dataclass(frozen=True)
class Transfers:
    """KV transfer totals an engine reports (the reads it made of another engine's blocks)."""

    count: float
    bytes: float
    seconds: float


@dataclass(frozen=True)
class Histo:
    """A latency histogram's running totals (its ``_sum`` and ``_count``): two readings give the mean of
    what was observed between them."""

    sum: float
    count: float


@dataclass(frozen=True)
class LoadSample:
    """One reading of an engine's own metrics."""

    epoch: float | None = None  # process start time: a new one means the engine restarted
    running: int = 0  # requests running
    waiting: int = 0  # admitted but not scheduled (no free KV blocks, or a full batch)
    kv_usage: float = 0.0  # share of its KV cache in use
    prefix_cache_hits: float | None = None  # prefix-cache hit tokens, a running total
    prefix_caching_off: bool = False  # it says its prefix cache is off
    block_size: int | None = None
    capacity_tokens: int | None = None  # its KV cache size in tokens
    transfers: Transfers | None = None
    # prompt and generated tokens computed, a running total (None: not reported): when it moves, the engine
    # is working, busy rather than stuck
    tokens_computed: float | None = None
    # latency histograms (None: not reported): the gaps between a stream's tokens (D's step time), how long
    # requests waited before their first step, and how long their prefill took once scheduled
    itl: Histo | None = None
    queue_time: Histo | None = None
    prefill_time: Histo | None = None


@dataclass(frozen=True)
class ModelCard:
    name: str
    max_model_len: int | None


class TurnCalls(Protocol):
    """The calls of one turn, each naming the instance by its base URL."""

    def check_request(self, body: Mapping[str, Any]) -> None:
        """Refuse, as a ``ClientError``, what this engine family does not let a client send (vLLM: its own
        ``kv_transfer_params``); called on the client's body before anything of the turn is done."""

    async def render(self, base: str, body: Mapping[str, Any], meta: CallMeta) -> list[int]:
        """The chat request's prompt as the engines will see it, in token ids (empty: an ``UpstreamError``)."""

    async def prefill(self, base: str, call: PrefillCall, meta: CallMeta) -> PrefillResult: ...

    async def open_decode(self, base: str, call: DecodeCall, meta: CallMeta) -> DecodeStream:
        """Send D the turn and return its answer once the engine accepted it (its first token may follow)."""

    async def decode_json(self, base: str, call: DecodeCall, meta: CallMeta, timeout_s: float) -> DecodeAnswer:
        """Send D the turn and read its whole answer within ``timeout_s``."""


class HandleRules(Protocol):
    """What a KV handle of this family holds, which pin it is, and how it is given back."""

    def read_handle(self, handle: Handle, *, seq_len: int, block_size: int) -> HandleFacts | HandleProblem:
        """What a handle D returned holds, given the sequence D computed (``seq_len`` tokens), or why it
        cannot be kept."""

    def pin_id(self, handle: Handle) -> str:
        """What tells this pin from any other (the stores key their pin index by it; a handle is released
        at most once)."""

    def pins_memory(self, handle: Handle) -> bool:
        """Whether the handle holds blocks on D that stay pinned until used or released."""

    async def release(self, base: str, handle: Handle, model: str | None) -> None:
        """Free the blocks ``handle`` pins on D, through the prefill engine at ``base``."""

    async def write_back(self, base: str, call: WriteBack) -> WriteBackResult:
        """Hand the blocks ``call.handle`` pins on D to the prefix cache of the prefill engine at ``base``
        (``WriteBack``); returns once P holds them and D has been told to free them. Raises an
        ``UpstreamError`` when P could not (D's blocks then stay pinned: release them)."""


class EngineProbes(Protocol):
    """The engine's own view of itself, read by the fleet's background loops and at start."""

    async def health(self, base: str) -> bool: ...

    async def info(self, base: str, role: str) -> EngineInfo | None:
        """Its version and what follows from it for an engine of ``role``; None when it cannot say now."""

    async def load(self, base: str) -> LoadSample | None:
        """A reading of its metrics; None when it cannot be read now."""

    async def models(self, base: str) -> list[ModelCard] | None:
        """The models it serves; None when it does not say."""


class PassThrough(Protocol):
    """The rest of its OpenAI-compatible API (``/tokenize``, ``/version``, ``/v1/models``), passed through."""

    async def api_get(self, base: str, path: str) -> tuple[int, bytes]: ...

    async def api_post(self, base: str, path: str, body: Any, meta: CallMeta) -> dict[str, Any]:
        """POST and read a JSON object; any status >= 400 raises ``UpstreamStatus`` with the body kept."""


class Engine(TurnCalls, HandleRules, EngineProbes, PassThrough, Protocol):
    """Everything turnkv asks of an engine family. Each part of turnkv takes the part it uses: the turn
    pipeline ``TurnCalls`` and ``HandleRules``, the releaser ``HandleRules``, the fleet ``EngineProbes``,
    the pass-through routes ``PassThrough``. ``EngineDefaults`` gives what a family may leave out."""

    @property
    def name(self) -> str: ...


class EngineDefaults:
    """What an engine family may leave out, inherited: it accepts every request, is healthy, says nothing
    of its version, load or models, and passes nothing through (404). A family that knows better says so."""

    def check_request(self, body: Mapping[str, Any]) -> None:
        return None

    async def health(self, base: str) -> bool:
        return True

    async def info(self, base: str, role: str) -> EngineInfo | None:
        return None

    async def load(self, base: str) -> LoadSample | None:
        return None

    async def models(self, base: str) -> list[ModelCard] | None:
        return None

    async def api_get(self, base: str, path: str) -> tuple[int, bytes]:
        return 404, b'{"error":{"message":"not served by this engine"}}'

    async def api_post(self, base: str, path: str, body: Any, meta: CallMeta) -> dict[str, Any]:
        raise UpstreamStatus(404, {"error": {"message": f"{path} is not served by this engine"}}, leg="render")

    async def write_back(self, base: str, call: WriteBack) -> WriteBackResult:
        """No write-back: the handle stays pinned, to be released."""
        raise UpstreamStatus(501, {"error": {"message": "write-back is not served by this engine"}}, leg="prefill")
