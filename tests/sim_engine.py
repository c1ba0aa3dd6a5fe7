"""``SimEngine``: a deterministic engine family in memory, made of the simulator's model, for in-process tests
of the pipeline where a wrong reuse must show (``turnkv.engine.mock.MockEngine`` is the double for tests
that only need scripted answers).

It keeps what makes a wrong reuse visible and nothing more: each position's KV is a hash of the tokens
that produced it (the simulator's oracle), KV pulled from D arrives verbatim, and the answer is drawn
from the KV at the end of the prompt, so blocks reused for other tokens change the answer.
``truth(body)`` is the answer a colocated engine gives the same request. Prompts are rendered with the
simulator's chat templates and tokenizer (``keep`` or ``strip``, which drops earlier reasoning).

P and D are instances by URL. A prefill computes the prompt (pulling D's pinned KV when the handle
says so, failing when D no longer holds it) and leaves it for D; D continues it, or computes the turn
itself (decode-local), and pins its sequence when it took P's KV (a handle in the answer's last event,
or in the body). Its metrics count the tokens it computed, requests waiting there and its pinned KV.
Faults per instance (``faults(url)``): fail, refuse the request, be unreachable, hang (stuck: computing
nothing), wait behind other work until ``free(url)`` (busy: its token count moves at every reading
meanwhile), never show a first token, drop the stream mid-way, end a stream without its handle, send an
error event before output. As with a real connection, a stream read while another read of it is pending raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv.engine.base import (
    CallMeta,
    DecodeAnswer,
    DecodeCall,
    DecodeStream,
    EngineDefaults,
    EngineInfo,
    Gathered,
    Handle,
    HandleFacts,
    HandleProblem,
    Histo,
    LoadSample,
    ModelCard,
    Piece,
    PrefillCall,
    PrefillResult,
    StreamBroken,
    WriteBack,
    WriteBackResult,
)
from turnkv.errors import UpstreamStatus, UpstreamTimeout, UpstreamUnavailable
from turnkv.sim.chat import ChatTemplate, Delta, OutputParser, RenderError
from turnkv.sim.oracle import ROOT_KV, Generator, Sampling, kv_extend, kv_step, opens_thinking
from turnkv.sim.tokenizer import Tokenizer

MODEL = "fake-model"
MAX_MODEL_LEN = 40960
DEFAULT_MAX_TOKENS = 64
EVENTS_PER_READ = 4  # a stream's events arrive a few per network read, as under load
NEVER_S = 60.0  # a hung call gives up after this, should nothing else end it first
_Event = tuple[bytes, bool, Delta | None, int | None]  # payload, shows output, its text, its token


@dataclass
class Faults:
    """What an instance does wrong, until the test changes it. Counts are used up one call at a time."""

    fail: int = 0  # the next calls answer HTTP 500
    refuse: int = 0  # the next calls answer HTTP 400: the engine refuses the request (as vLLM its own checks)
    hang: int = 0  # the next calls never answer: a deadline or an abort must end them
    busy: int = 0  # the next calls (a stream: its first output) wait behind other work until ``free(url)``
    leg: str | None = None  # the calls ``fail`` and ``hang`` apply to (render, prefill, decode...): None, all
    unreachable: bool = False  # calls cannot connect (and health checks fail)
    stall: int = 0  # the next streams open, then never show output
    drop: int = 0  # the next streams end, without their end, after ``drop_after`` events with output
    drop_after: int = 0
    freeze: int = 0  # the next streams stop after ``drop_after`` events with output, left open, silent
    error: int = 0  # the next streams report an error before any output
    no_handle_in_stream: bool = False  # streams end without D's handle (vLLM < 0.33 without the plugin)
    no_handle: bool = False  # D answers without a handle at all
    bad_handle: str | None = None  # D's handle is broken this way (a ``HandleProblem`` value)
    no_token_ids: bool = False  # D's answer (P's, when asked) does not say its prompt's token ids


@dataclass(frozen=True)
class StreamFaults:
    stall: bool = False
    busy: bool = False
    drop_after: int | None = None
    freeze_after: int | None = None
    error: bool = False


@dataclass
class Pin:
    tokens: list[int]
    kv: list[int]  # the KV of tokens[:len(kv)]


@dataclass
class Instance:
    url: str
    role: str
    faults: Faults = field(default_factory=Faults)
    epoch: float = field(default_factory=time.time)
    running: int = 0
    waiting: int = 0  # others' requests queued there, as its metrics say
    kv_usage: float | None = None  # as its metrics say (None: what its pins hold of its capacity)
    computed: int = 0  # prompt and generated tokens computed, as its metrics say
    behind: int = 0  # calls of ours waiting behind other work (``Faults.busy``)
    freed: asyncio.Event = field(default_factory=asyncio.Event)  # the other work is done (``free``)
    prefix_hits: int = 0
    capacity_tokens: int | None = None
    gpus: frozenset[str] = frozenset()  # the GPUs it says it computes on (as turnkv's vLLM plugin says them)
    # latencies its metrics report (None: no such histogram): each read of its metrics adds one request
    # that waited ``queue_ms`` to be scheduled and, on P, one prefill of ``prefill_ms``
    queue_ms: float | None = None
    prefill_ms: float | None = None
    reads: int = 0
    hung: int = 0  # calls hanging now (``Faults.hang``): one given up on is cancelled, and ends
    cached: set[int] = field(default_factory=set)  # hashes of the block-aligned prefixes it computed
    staged: dict[str, list[int]] = field(default_factory=dict)  # P: prompt KV prefilled for a D, by id
    pins: dict[str, Pin] = field(default_factory=dict)  # D: sequences pinned for a next turn, by id
    released: list[str] = field(default_factory=list)  # D: pins freed by a release
    calls: list[str] = field(default_factory=list)  # what it was asked: render, prefill, decode, release, write_back

    @property
    def pinned_tokens(self) -> int:
        return sum(len(p.kv) for p in self.pins.values())


@dataclass(frozen=True)
class Generated:
    """An answer: its ids, its parsed text per event, and the KV of every position that has one."""

    ids: list[int]
    deltas: list[Delta]
    finish_reason: str
    kv: list[int]  # prompt and answer, but for the last token (it has no KV yet)
    reasoning: str
    content: str | None
    tool_calls: list[dict[str, Any]]


class SimEngine(EngineDefaults):
    name = "sim"

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        template: str = "keep",
        block_size: int = 16,
        model: str = MODEL,
        drift: bool = False,
    ) -> None:
        self.tok = Tokenizer.shared()
        self.drift = drift  # answers hold words that tokenize differently when sent back
        self.template = ChatTemplate.load(template)
        self.block_size = block_size
        self.model = model
        self.instances = {u: Instance(u, "prefill") for u in prefill} | {u: Instance(u, "decode") for u in decode}
        self._ids = itertools.count(1)

    # -- for tests ---------------------------------------------------------------------------------
    def __getitem__(self, url: str) -> Instance:
        return self.instances[url]

    def faults(self, url: str, **changes: Any) -> Faults:
        inst = self.instances[url]
        inst.faults = dataclasses.replace(inst.faults, **changes)
        return inst.faults

    def free(self, url: str) -> None:
        """The other work on ``url`` is done: calls waiting behind it go on."""
        self.instances[url].freed.set()

    def restart(self, url: str) -> None:
        """A new process: a new epoch, and nothing cached, staged or pinned."""
        inst = self.instances[url]
        inst.epoch = max(time.time(), inst.epoch + 1)
        inst.cached.clear()
        inst.staged.clear()
        inst.pins.clear()

    def truth(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The answer a colocated engine gives ``body``: its message as a client sees it."""
        prompt = self._prompt(body, None)
        g = self._generate(body, prompt, kv_extend(ROOT_KV, prompt, 0))
        return _message(g)

    # -- calls -------------------------------------------------------------------------------------
    async def _enter(self, base: str, leg: str, timeout_s: float | None = None, *, stream: bool = False) -> Instance:
        inst = self.instances.get(base)
        if inst is None or inst.faults.unreachable:
            raise UpstreamUnavailable(f"{leg} engine unreachable: ConnectionRefusedError", leg=leg, instance=base)
        inst.calls.append(leg)
        f = inst.faults
        if f.leg not in (None, leg):
            return inst
        if f.hang > 0:
            f.hang -= 1
            inst.hung += 1
            try:
                await asyncio.wait_for(asyncio.Event().wait(), min(timeout_s or NEVER_S, NEVER_S))
            except TimeoutError:
                raise UpstreamTimeout(f"{leg} engine timed out", leg=leg, instance=base) from None
            finally:
                inst.hung -= 1
        if f.busy > 0 and not (leg == "decode" and stream):
            f.busy -= 1
            await _behind(inst, leg, timeout_s)
        if f.fail > 0:
            f.fail -= 1
            raise UpstreamStatus(500, {"error": {"message": "fake engine failure"}}, leg=leg, instance=base)
        if f.refuse > 0:
            f.refuse -= 1
            refusal = {"error": {"message": "fake engine refusal", "type": "BadRequestError", "code": 400}}
            raise UpstreamStatus(400, refusal, leg=leg, instance=base)
        return inst

    async def render(self, base: str, body: Mapping[str, Any], meta: CallMeta) -> list[int]:
        await self._enter(base, "render")
        ids = self._prompt(body, None)
        if not ids:
            raise UpstreamStatus(
                502, {"error": {"message": "render returned no token ids"}}, leg="render", instance=base
            )
        return ids

    async def prefill(self, base: str, call: PrefillCall, meta: CallMeta) -> PrefillResult:
        p = await self._enter(base, "prefill", call.timeout_s)
        prompt = self._prompt(call.body, call.prompt_ids)
        pulled: list[int] = []
        use = call.handle
        if use is not None:
            d, pin = self._pin_of(use.handle)
            if pin is None or d is None:
                raise UpstreamStatus(
                    500,
                    {"error": {"message": "KV transfer failed: the handle is unknown"}},
                    leg="prefill",
                    instance=base,
                )
            del d.pins[str(use.handle["remote_request_id"])]  # read (or released): D frees the blocks
            if use.tokens == 0:
                d.released.append(str(use.handle["remote_request_id"]))
            pulled = pin.kv[: min(use.tokens, len(prompt))]
        cached = self._cached(p, prompt)
        start = len(pulled)
        kv = pulled + kv_extend(pulled[-1] if pulled else ROOT_KV, prompt[start:], start)
        p.computed += len(prompt) - max(cached, start)
        self._remember(p, prompt)
        stage = f"stage-{next(self._ids)}"
        p.staged[stage] = kv
        return PrefillResult(
            for_decode={"fake_prefill": base, "stage": stage},
            cached_tokens=max(cached, start),
            prompt_tokens=len(prompt),
            prompt_ids=list(prompt) if call.return_ids and not p.faults.no_token_ids else None,
        )

    def _pin_of(self, handle: Handle) -> tuple[Instance | None, Pin | None]:
        d = self.instances.get(str(handle.get("engine")))
        if d is None or handle.get("epoch", d.epoch) != d.epoch:  # pins die with their process
            return d, None
        return d, d.pins.get(str(handle.get("remote_request_id")))

    async def _decode(
        self, base: str, call: DecodeCall, timeout_s: float | None
    ) -> tuple[Instance, Generated, int, Handle | None]:
        d = await self._enter(base, "decode", timeout_s, stream=call.stream)
        prompt = self._prompt(call.body, call.prompt_ids)
        cached = self._cached(d, prompt)
        if call.for_decode:
            p = self.instances.get(str(call.for_decode.get("fake_prefill")))
            kv = p.staged.pop(str(call.for_decode.get("stage")), None) if p is not None else None
            if kv is None or len(kv) != len(prompt):
                raise UpstreamStatus(500, {"error": {"message": "prefilled KV not found"}}, leg="decode", instance=base)
            cached = len(prompt) - 1  # all of it came from P; D computes the last token again, as vLLM's D does
        else:
            kv = kv_extend(ROOT_KV, prompt, 0)  # decode-local: its prefix cache is keyed by tokens, so exact
        g = self._generate(call.body, prompt, kv)
        d.computed += len(prompt) - cached + (0 if call.stream else len(g.ids))  # a stream's tokens: as it is read
        self._remember(d, prompt + g.ids)
        handle: Handle | None = None
        if call.for_decode and not d.faults.no_handle:  # D pins what it computed, for a next turn
            pin = f"pin-{next(self._ids)}"
            d.pins[pin] = Pin(prompt + g.ids, g.kv)
            handle = {"engine": base, "remote_request_id": pin, "epoch": d.epoch, "tokens": len(g.kv)}
            handle = _broken(handle, d.faults.bad_handle)
        return d, g, cached, handle

    async def open_decode(self, base: str, call: DecodeCall, meta: CallMeta) -> FakeStream:
        d, g, cached, handle = await self._decode(base, call, None)
        prompt = self._prompt(call.body, call.prompt_ids)
        collected = Gathered(prompt_token_ids=prompt if call.track and not d.faults.no_token_ids else None)
        f = d.faults
        if f.no_handle_in_stream:
            handle = None
        faults = StreamFaults(
            stall=f.stall > 0,
            busy=f.busy > 0,
            drop_after=f.drop_after if f.drop > 0 else None,
            freeze_after=f.drop_after if f.freeze > 0 else None,
            error=f.error > 0,
        )
        f.stall, f.busy, f.drop, f.freeze, f.error = (
            max(n - 1, 0) for n in (f.stall, f.busy, f.drop, f.freeze, f.error)
        )
        return FakeStream(d, call, g, collected, handle, _usage(len(prompt), g, cached, call), faults)

    async def decode_json(self, base: str, call: DecodeCall, meta: CallMeta, timeout_s: float) -> DecodeAnswer:
        d, g, cached, handle = await self._decode(base, call, timeout_s)
        prompt = self._prompt(call.body, call.prompt_ids)
        message = _message(g)
        collected = Gathered(
            token_ids=list(g.ids),
            finish_reason=g.finish_reason,
            handle=handle,
            prompt_token_ids=prompt if call.track and not d.faults.no_token_ids else None,
        )
        collected.answer.message(message)
        body = {
            "id": "fake",
            "object": "chat.completion",
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": g.finish_reason}],
            "usage": _usage(len(prompt), g, cached, call),
        }
        return DecodeAnswer(body, collected)

    async def release(self, base: str, handle: Handle, model: str | None) -> None:
        await self._enter(base, "release")
        d, pin = self._pin_of(handle)
        if d is not None and pin is not None:
            del d.pins[str(handle["remote_request_id"])]
            d.released.append(str(handle["remote_request_id"]))

    async def write_back(self, base: str, call: WriteBack) -> WriteBackResult:
        p = await self._enter(base, "write_back", call.timeout_s)
        d, pin = self._pin_of(call.handle)
        if pin is None or d is None:
            raise UpstreamStatus(
                500, {"error": {"message": "KV transfer failed: the handle is unknown"}}, leg="prefill", instance=base
            )
        del d.pins[str(call.handle["remote_request_id"])]  # read: D frees the blocks
        self._remember(p, call.token_ids[: len(pin.kv)])  # in P's prefix cache now, unpinned
        return WriteBackResult.CACHED

    # -- handles -----------------------------------------------------------------------------------
    def read_handle(self, handle: Handle, *, seq_len: int, block_size: int) -> HandleFacts | HandleProblem:
        n = handle.get("tokens")
        if not isinstance(n, int) or "engine" not in handle:
            return HandleProblem.NOT_A_DECODE_HANDLE
        if not 0 < n <= seq_len:
            return HandleProblem.INCONSISTENT
        if "epoch" not in handle:
            return HandleProblem.INCOMPLETE
        return HandleFacts(tokens=n, engine_id=str(handle["engine"]))

    def pin_id(self, handle: Handle) -> str:
        return str(handle.get("remote_request_id"))

    def pins_memory(self, handle: Handle) -> bool:
        return "remote_request_id" in handle

    # -- the engine's own view ---------------------------------------------------------------------
    async def health(self, base: str) -> bool:
        inst = self.instances.get(base)
        return inst is not None and not inst.faults.unreachable

    async def info(self, base: str, role: str) -> EngineInfo | None:
        inst = self.instances.get(base)
        if inst is None or inst.faults.unreachable:
            return None
        return EngineInfo(
            version="fake",
            stream_handles=None if inst.faults.no_handle_in_stream else True,
            takes_prompt_ids=True,
            gpus=inst.gpus,
        )

    async def load(self, base: str) -> LoadSample | None:
        inst = self.instances.get(base)
        if inst is None or inst.faults.unreachable:
            return None
        cap = inst.capacity_tokens
        if inst.behind:
            inst.computed += 1  # the work they wait behind goes on
        inst.reads += 1
        n = inst.reads
        return LoadSample(
            epoch=inst.epoch,
            running=inst.running,
            waiting=inst.waiting + inst.behind,
            kv_usage=inst.kv_usage if inst.kv_usage is not None else inst.pinned_tokens / cap if cap else 0.0,
            tokens_computed=float(inst.computed),
            prefix_cache_hits=float(inst.prefix_hits),
            block_size=self.block_size,
            capacity_tokens=cap,
            queue_time=None if inst.queue_ms is None else Histo(n * inst.queue_ms / 1e3, n),
            prefill_time=None if inst.prefill_ms is None else Histo(n * inst.prefill_ms / 1e3, n),
        )

    async def models(self, base: str) -> list[ModelCard] | None:
        await self._enter(base, "probe")
        return [ModelCard(self.model, MAX_MODEL_LEN)]

    async def api_get(self, base: str, path: str) -> tuple[int, bytes]:
        await self._enter(base, "probe")
        if path == "/v1/models":
            return 200, json.dumps(
                {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": MAX_MODEL_LEN}]}
            ).encode()
        if path == "/version":
            return 200, b'{"version":"fake"}'
        return 404, b'{"error":{"message":"not found"}}'

    async def api_post(self, base: str, path: str, body: Any, meta: CallMeta) -> dict[str, Any]:
        await self._enter(base, "render")
        if path == "/tokenize" and isinstance(body, Mapping):
            ids = self._prompt(body, None)
            return {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
        if path == "/detokenize" and isinstance(body, Mapping):
            return {"prompt": self.tok.decode(body.get("tokens") or [])}
        raise UpstreamStatus(404, {"error": {"message": f"{path} not found"}}, leg="render", instance=base)

    # -- the model -----------------------------------------------------------------------------------
    def _prompt(self, body: Mapping[str, Any], ids: Sequence[int] | None) -> list[int]:
        if ids is not None:
            return list(ids)
        if "messages" in body:
            try:
                text = self.template.render(
                    body["messages"],
                    tools=body.get("tools"),
                    add_generation_prompt=body.get("add_generation_prompt", True),
                )
            except RenderError as exc:
                raise UpstreamStatus(400, {"error": {"message": str(exc)}}, leg="render") from exc
            return self.tok.encode(text)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return self.tok.encode(prompt if isinstance(prompt, str) else json.dumps(prompt))

    def _cached(self, inst: Instance, prompt: Sequence[int]) -> int:
        """Prompt tokens its prefix cache holds: whole blocks, never the last token."""
        bs, n = self.block_size, 0
        for end in range(bs, len(prompt), bs):
            if hash(tuple(prompt[:end])) not in inst.cached:
                break
            n = end
        inst.prefix_hits += n
        return n

    def _remember(self, inst: Instance, tokens: Sequence[int]) -> None:
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            inst.cached.add(hash(tuple(tokens[:end])))

    def _generate(self, body: Mapping[str, Any], prompt: list[int], kv: list[int]) -> Generated:
        tools = body.get("tools") or ()
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        thinking = opens_thinking(self.tok, prompt) if "messages" in body else False
        gen = Generator(
            self.tok,
            Sampling(
                max_tokens=int(limit),
                thinking=thinking,
                tools=tools,
                drift=self.drift,
                tool_choice=body.get("tool_choice") or ("auto" if tools else "none"),
            ),
        )
        parser = OutputParser(self.tok, parse_tools=bool(tools), thinking=thinking)
        ids: list[int] = []
        deltas: list[Delta] = []
        kv = list(kv)
        finish = "length"
        while len(ids) < int(limit):
            token = gen.next_token(kv[-1], len(ids))
            if token == self.tok.eos_id:
                finish = "stop"
                break
            kv.append(kv_step(kv[-1], token, len(prompt) + len(ids)))
            ids.append(token)
            deltas.append(parser.feed(token))
        deltas.append(parser.finish())
        if parser.tool_calls:
            finish = "tool_calls"
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parser.final_tool_calls()
        ]
        return Generated(ids, deltas, finish, kv[:-1], parser.reasoning, parser.final_content(), calls)


async def _behind(inst: Instance, leg: str, timeout_s: float | None) -> None:
    """Wait behind the instance's other work until it is done (``SimEngine.free``), or ``timeout_s``."""
    inst.behind += 1
    try:
        await asyncio.wait_for(inst.freed.wait(), min(timeout_s or NEVER_S, NEVER_S))
    except TimeoutError:
        raise UpstreamTimeout(f"{leg} engine timed out", leg=leg, instance=inst.url) from None
    finally:
        inst.behind -= 1


def _broken(handle: Handle, how: str | None) -> Handle:
    if how == HandleProblem.NOT_A_DECODE_HANDLE:
        return {k: v for k, v in handle.items() if k != "tokens"}
    if how == HandleProblem.INCONSISTENT:
        return {**handle, "tokens": 10**9}
    if how == HandleProblem.INCOMPLETE:
        return {k: v for k, v in handle.items() if k != "epoch"}
    return handle


def _message(g: Generated) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": g.content}
    if g.reasoning:
        m["reasoning"] = g.reasoning
    if g.tool_calls:
        m["tool_calls"] = g.tool_calls
    return m


def _usage(prompt: int, g: Generated, cached: int, call: DecodeCall) -> dict[str, Any]:
    shown = cached if call.cached_tokens is None else min(call.cached_tokens, prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": len(g.ids),
        "total_tokens": prompt + len(g.ids),
        "prompt_tokens_details": {"cached_tokens": shown},
    }


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj: dict[str, Any] = {"id": "fake", "object": "chat.completion.chunk", "model": MODEL, "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return json.dumps(obj, separators=(",", ":")).encode()


class FakeStream(DecodeStream):
    """D's answer as events, a few per read, with the instance's stream faults applied."""

    def __init__(
        self,
        d: Instance,
        call: DecodeCall,
        g: Generated,
        collected: Gathered,
        handle: Handle | None,
        usage: dict[str, Any],
        faults: StreamFaults,
    ) -> None:
        self._d = d
        self._collected = collected
        self._handle = handle
        self._faults = faults
        self._finish = g.finish_reason
        self._events = self._plan(g, call, usage)
        self._shown = 0
        self._dropped = False
        self._frozen = False
        self._reading = False
        self._queued = faults.busy  # its first output is still behind the engine's other work
        self._closing = asyncio.Event()
        self.closed = False
        self.aborted = False
        d.running += 1

    @staticmethod
    def _plan(g: Generated, call: DecodeCall, usage: dict[str, Any]) -> list[_Event]:
        """The answer's events, the last but usage with the finish."""
        out: list[_Event] = [(_chunk({"role": "assistant", "content": ""}), False, None, None)]
        for i, (token, delta) in enumerate(zip(g.ids, g.deltas, strict=False)):
            if i == len(g.ids) - 1:
                _merge(delta, g.deltas[-1])
            d = _delta(delta)
            out.append((_chunk(d), bool(d), delta, token))
        if not g.ids:
            out.append((_chunk(_delta(g.deltas[-1])), bool(_delta(g.deltas[-1])), g.deltas[-1], None))
        out.append((_chunk({}, g.finish_reason), True, None, None))
        opts = call.body.get("stream_options")
        if isinstance(opts, Mapping) and opts.get("include_usage"):
            out.append((_chunk(None, usage=usage), False, None, None))
        return out

    @property
    def collected(self) -> Gathered:
        return self._collected

    async def read(self) -> list[Piece] | None:
        if self._reading:  # as aiohttp's readany(): one reader at a time
            raise RuntimeError("read() called while another coroutine is already waiting for incoming data")
        self._reading = True
        try:
            return await self._read()
        finally:
            self._reading = False

    async def _read(self) -> list[Piece] | None:
        f, c = self._faults, self._collected
        if self.done or self.closed or self._dropped:
            return None
        if f.stall or self._frozen:  # until the reader gives up, or the stream is closed under it (then it ends)
            try:
                await asyncio.wait_for(self._closing.wait(), NEVER_S)
            except TimeoutError:
                raise StreamBroken("TimeoutError") from None
            return None
        if self._queued:
            try:
                await _behind(self._d, "decode", None)
            except UpstreamTimeout:
                raise StreamBroken("TimeoutError") from None
            self._queued = False
            if self.closed:
                return None
        if f.error and c.error is None:
            c.error = {"message": "fake engine error before output"}
            return [(json.dumps({"error": c.error}).encode(), False, True)]
        pieces: list[Piece] = []
        while self._events and len(pieces) < EVENTS_PER_READ:
            if f.drop_after is not None and self._shown >= f.drop_after:
                self._dropped = True  # the connection ends without the end marker
                return pieces or None
            if f.freeze_after is not None and self._shown >= f.freeze_after and not self._frozen:
                self._frozen = True  # nothing more, the connection left open
                return pieces or await self._read()
            payload, visible, delta, token = self._events.pop(0)
            if token is not None:
                c.token_ids.append(token)
                self._d.computed += 1
            if delta is not None:
                c.answer.delta(_delta(delta))
            if b'"finish_reason":"' in payload:
                c.finish_reason = self._finish
                c.handle = self._handle
            self._shown += visible
            pieces.append((payload, visible, c.error is not None))
        if not self._events:
            self.done = True
        return pieces

    async def drain(self, timeout_s: float) -> None:
        return None

    async def salvage(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError, StreamBroken):
            async with asyncio.timeout(timeout_s):
                while await self.read() is not None:
                    pass

    def close(self) -> None:
        self._closing.set()
        if not self.closed:
            self.closed = True
            self._d.running -= 1
            if not self.done and self._handle is not None and self._collected.handle is None:
                # aborted before its end: D frees the request's blocks, nothing stays pinned for it
                self._d.pins.pop(str(self._handle.get("remote_request_id")), None)

    def abort(self) -> None:
        self.aborted = True
        self.close()


def _delta(d: Delta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if d.reasoning:
        out["reasoning"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = [
            {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in d.tool_calls
        ]
    return out


def _merge(into: Delta, d: Delta) -> None:
    into.reasoning += d.reasoning
    into.content += d.content
    into.tool_calls += d.tool_calls


__all__ = ["MODEL", "SimEngine", "Faults"]
