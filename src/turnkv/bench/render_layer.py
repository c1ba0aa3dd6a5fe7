"""The render layer's cost, on the simulator: what streaming derender costs a render service, and how many
render replicas a request rate needs (``turnkv bench render-layer``).

``derender``: one long answer (``--output-tokens`` with a ``--prompt-tokens`` prompt) is derendered the
ways a router can, its ids replayed as D's stream at ``--itl-ms``: one non-streaming call; vLLM's streaming
derender one call per token, and batched; turnkv's incremental path with text from the render service's
``/detokenize``, and from a tokenizer in the router's process. For each: the render service's modelled core
seconds (``sim.render.RenderCosts``, fitted to vLLM 0.34 on 2 cores) and calls, the ratio to the
non-streaming call, this process's CPU seconds (the router's side), how long batching held the first token,
and whether the streamed text adds up to the non-streaming answer.

``capacity``: from the cost model alone (no processes), the render-core milliseconds one request takes
(its render and its answer's derender) per prompt length and way of derendering, and the cores a request
rate needs at a utilisation target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from turnkv import launch
from turnkv.derender import (
    AiohttpPoster,
    Answer,
    Chunk,
    Delta,
    Derender,
    DerenderConfig,
    Ending,
    FlushPolicy,
    FlushStats,
    Output,
    RenderClient,
    StreamDerenderer,
    reasoning_open,
    relay,
)
from turnkv.sim.render import RenderCosts
from turnkv.sim.tokenizer import Tokenizer

MODEL = "sim-model"


@dataclass(frozen=True)
class Way:
    name: str
    mode: str  # DerenderConfig.mode; "whole": one non-streaming call; "replay": D's stream read, no derender
    policy: FlushPolicy = FlushPolicy()
    local: bool = False
    each: bool = False  # one call a chunk, each awaited before D is read on (no batching at all)


WAYS = (
    Way("non-streaming (one call)", "whole"),
    Way("D's stream replayed alone (no derender)", "replay"),
    Way("vLLM streaming derender, 1 token a call", "vllm-stream", each=True),
    Way("vLLM streaming derender, batched 16 / 50 ms", "vllm-stream", FlushPolicy(16, 0.05)),
    Way("turnkv incremental, /detokenize, batched 16 / 50 ms", "incremental", FlushPolicy(16, 0.05)),
    Way("turnkv incremental, /detokenize, batched 32 / 100 ms", "incremental", FlushPolicy(32, 0.1)),
    Way("turnkv incremental, tokenizer in process", "incremental", FlushPolicy.immediate(), local=True),
)


@dataclass
class WayResult:
    way: str
    render_core_s: float
    render_calls: int
    ratio_to_non_streaming: float
    router_cpu_s: float
    first_token_batching_wait_ms: float | None
    first_delta_ms: float | None
    adds_up: bool
    diverged: bool


def prompt_text(tokens: int, seed: int = 0) -> str:
    """A user message of about ``tokens`` simulator tokens (one word each)."""
    words = Tokenizer().words
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(tokens))


async def _state(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(base + "/_sim/state") as r:
        return dict(await r.json())


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> Any:
    async with session.post(url, json=body) as r:
        if r.status >= 400:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        return await r.json()


async def paced(ids: Sequence[int], finish: str, itl_s: float) -> AsyncIterator[Chunk]:
    """D's stream: one id a chunk, one every ``itl_s``."""
    start = time.perf_counter()
    for i, t in enumerate(ids):
        wait = start + i * itl_s - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield Chunk([t], finish if i == len(ids) - 1 else None)


async def one_call_a_chunk(chunks: AsyncIterator[Chunk], sd: StreamDerenderer) -> AsyncIterator[Delta | Ending]:
    """A naive router: each chunk's ids derendered, and awaited, before the next chunk is read."""
    async for c in chunks:
        if c.finish_reason is not None:
            yield await sd.finish(c.token_ids, c.finish_reason, "x")
            return
        yield await sd.feed(c.token_ids)


@dataclass
class Case:
    """The answer every way derenders: render's request, D's ids, and the non-streaming truth."""

    chat: dict[str, Any]
    rendered: dict[str, Any]
    ids: list[int]
    finish: str
    whole: Answer | None = None


async def streamed(case: Case, d: Derender, way: Way, itl_s: float, stats: FlushStats) -> tuple[Delta, Ending, float]:
    """The stream's text as the client got it, its ending, and when its first delta came (ms)."""
    sd = d.stream(
        model=MODEL,
        prompt_ids=case.rendered["token_ids"],
        chat_request=case.chat,
        request_id=case.rendered["request_id"],
        reasoning_open=reasoning_open(case.rendered, case.chat),
    )
    source = paced(case.ids, case.finish, itl_s)
    feed = one_call_a_chunk(source, sd) if way.each else relay(source, sd, way.policy, request_id="x", stats=stats)
    text, ending, first = Delta(), None, None
    t0 = time.perf_counter()
    async for x in feed:
        if isinstance(x, Ending):
            ending = x
            x = x.rest
        if first is None and x:
            first = (time.perf_counter() - t0) * 1e3
        text = Delta(text.reasoning + x.reasoning, text.content + x.content)
    assert ending is not None
    return text, ending, first or 0.0


async def measure(
    session: aiohttp.ClientSession, render: str, client: RenderClient, case: Case, way: Way, a: argparse.Namespace
) -> WayResult:
    version = (0, 26) if a.compat == "0.26" else (0, 33)
    mode = "incremental" if way.mode in ("whole", "replay") else way.mode
    config = DerenderConfig(mode=mode, policy=way.policy)  # type: ignore[arg-type]
    d = Derender(client, version, config, local_decode=Tokenizer().decode if way.local else None)
    before = await _state(session, render)
    cpu0 = time.process_time()
    stats = FlushStats()
    first: float | None = None
    adds_up, diverged = True, False
    if way.mode == "whole":
        out = Output(case.rendered["request_id"], case.ids, case.finish)
        case.whole = await d.whole(out, model=MODEL, prompt_ids=case.rendered["token_ids"], chat_request=case.chat)
    elif way.mode == "replay":
        async for _ in paced(case.ids, case.finish, a.itl_ms / 1e3):
            pass
    else:
        text, ending, first = await streamed(case, d, way, a.itl_ms / 1e3, stats)
        assert case.whole is not None
        adds_up = text.content == (case.whole.content or "") and text.reasoning == (case.whole.reasoning or "")
        diverged = ending.diverged
    cpu = time.process_time() - cpu0
    after = await _state(session, render)
    wait = stats.first_token_wait_s
    return WayResult(
        way.name,
        round(sum(after["busy_s"].values()) - sum(before["busy_s"].values()), 4),
        sum(after["calls"].values()) - sum(before["calls"].values()),
        0.0,
        round(cpu, 4),
        None if wait is None else round(wait * 1e3, 3),
        None if first is None else round(first, 2),
        adds_up,
        diverged,
    )


async def derender_costs(render: str, engine: str, a: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        client = RenderClient([render], AiohttpPoster(session))
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt_text(a.prompt_tokens)}],
            "max_tokens": a.output_tokens,
            "ignore_eos": True,
        }
        rendered = await client.render_chat(chat)
        generated = await _post(session, engine + "/inference/v1/generate", rendered)
        choice = generated["choices"][0]
        case = Case(chat, rendered, choice["token_ids"], choice["finish_reason"])
        results = []
        for way in WAYS:
            if way.mode == "vllm-stream" and a.compat == "0.26":
                continue  # no streaming derender before 0.27 (with parsers 0.31)
            results.append(await measure(session, render, client, case, way, a))
        base = results[0].render_core_s
        for r in results:
            r.ratio_to_non_streaming = round(r.render_core_s / base, 2)
        return {
            "prompt_tokens": len(rendered["token_ids"]),
            "output_tokens": len(case.ids),
            "itl_ms": a.itl_ms,
            "compat": a.compat,
            "ways": [asdict(r) for r in results],
        }


def capacity(a: argparse.Namespace) -> dict[str, Any]:
    """Render cores a request rate needs at ``--utilisation``, from the cost model: a request is one render
    of its prompt and the derender of its ``--output-tokens`` answer, by way of derendering it."""
    costs = RenderCosts()
    out = []
    n = a.output_tokens
    for tokens in a.prompts:
        render = costs.render(tokens)
        ways = {
            "non-streaming": costs.derender(n),
            "turnkv incremental, tokenizer in process": costs.derender(n),
            "turnkv incremental, /detokenize every 16": costs.derender(n) + (n / 16) * costs.detokenize(20),
            "vLLM streaming derender, every 16": sum(costs.stream_call(tokens, 16 * k, 16, k) for k in range(n // 16)),
            "vLLM streaming derender, every token": sum(costs.stream_call(tokens, k, 1, k) for k in range(n)),
        }
        for way, derender in ways.items():
            per_request = render + derender
            out.append(
                {
                    "prompt_tokens": tokens,
                    "way": way,
                    "render_ms": round(render * 1e3, 1),
                    "core_ms_per_request": round(per_request * 1e3, 1),
                    "requests_per_core_per_s": round(a.utilisation / per_request, 2),
                    "cores_for_rate": {str(r): math.ceil(r * per_request / a.utilisation) for r in a.rates},
                }
            )
    return {"output_tokens": n, "utilisation": a.utilisation, "model": asdict_costs(costs), "rows": out}


def plot_capacity(result: dict[str, Any], path: Path) -> None:
    """Render cores against request rate, per way of derendering, at each prompt length (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is not installed: the table is the result
        return
    prompts = sorted({r["prompt_tokens"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(prompts), figsize=(4 * len(prompts), 3.4), sharey=True)
    rates = [1, 2, 5, 10, 20, 50, 100, 200]
    for ax, prompt in zip(axes if len(prompts) > 1 else [axes], prompts, strict=True):
        for r in (r for r in result["rows"] if r["prompt_tokens"] == prompt):
            per = r["core_ms_per_request"] / 1e3
            ax.plot(
                rates, [max(1, math.ceil(x * per / result["utilisation"])) for x in rates], marker=".", label=r["way"]
            )
        ax.set(xscale="log", yscale="log", title=f"{prompt // 1000}k-token prompts", xlabel="requests/s")
        ax.grid(True, which="both", alpha=0.3)
    (axes[0] if len(prompts) > 1 else axes).set_ylabel("render cores needed")
    fig.legend(*fig.axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7)
    fig.suptitle(
        f"Render cores for a request rate ({result['output_tokens']}-token answers, {result['utilisation']:.0%} busy)"
    )
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def asdict_costs(costs: RenderCosts) -> dict[str, float]:
    return {k: float(v) for k, v in costs.model_dump().items()}


def run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "capacity":
        result = capacity(a)
        plot_capacity(result, out / "capacity.png")
    else:
        flags = ("--vllm-compat", a.compat, "--time-scale", "0")
        with ExitStack() as stack:
            r = launch.sim("render", "render", *flags, log_dir=out)
            stack.callback(r.stop)
            e = launch.sim("engine", "colocated", "--tokens-only", *flags, log_dir=out)
            stack.callback(e.stop)
            result = asyncio.run(derender_costs(r.url, e.url, a))
    path = out / f"{a.what}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0
