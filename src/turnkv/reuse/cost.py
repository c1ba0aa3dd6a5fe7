"""Pure estimates of a turn's time to first token under each way of running it, and of what a
decode-local turn costs the streams already on that D.

Three ways: ``recompute`` (P computes what its prefix cache lacks), ``pull`` (P pulls D's blocks
for the reusable part, then computes the rest) and ``decode_local`` (the decode engine that holds
the conversation prefills the new tokens itself: no P hop, no transfers). The parameters are
measurements (see ``reuse.estimator``), not constants; the defaults are the project's H200 host.

A decode-local turn is not free for D's other streams: vLLM schedules its prefill into D's steps
(chunked, beside every running stream's decode token, within ``max_num_batched_tokens``), and each
step that carries a chunk lasts longer for every stream (``step_added_s``). The step model is the
simulator's (``turnkv.sim.costs``): a fixed cost, per stream, per token of context read, compute past
the tokens a step does for free, and the prefill's attention; the priors are the H200's until
``gpu/step_time.py`` has measured them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.StrEnum):
    PULL = "pull"
    RECOMPUTE = "recompute"
    DECODE_LOCAL = "decode_local"


@dataclass(frozen=True)
class CostParams:
    link_fixed_s: float = 0.002  # per KV transfer, D -> P (P pulls D's blocks)
    link_bytes_per_s: float = 0.43e9  # KV transfer bandwidth, D -> P
    # P -> D (D reads P's blocks after every P leg); links can be very asymmetric (CUDA IPC on one
    # H200: 172-352 GB/s one way, 5-21 GB/s back). None: the same as D -> P.
    push_fixed_s: float | None = None
    push_bytes_per_s: float | None = None
    kv_bytes_per_token: int = 147456
    prefill_per_token_s: float = 25e-6
    prefill_attn_s: float = 1.2e-9  # per new token per token of context
    prefill_floor_s: float = 0.010
    hop_s: float = 0.003  # one HTTP request to an engine, end to end, without compute
    recompute_threshold: int = 64  # vLLM's kv_recompute_threshold: smaller pulls are not made
    # D's step (see the module docstring): its fixed cost, per running stream, per token of context the
    # streams read, the tokens a step computes within its fixed cost, and D's token budget per step
    step_base_s: float = 0.008
    step_per_seq_s: float = 0.00005
    step_per_ctx_token_s: float = 50e-9
    step_free_tokens: int = 128
    max_num_batched_tokens: int = 8192
    # D's --long-prefill-token-threshold: the most tokens of one prefill a step takes (0: all the budget
    # leaves). Small chunks keep a decode-local turn's cost per step within the step's free tokens, at the
    # price of more steps before its first token.
    decode_chunk_tokens: int = 0

    def link(self, *, push: bool = False) -> tuple[float, float]:
        """(fixed seconds per transfer, bytes per second) of D -> P, or of P -> D with ``push``."""
        if not push:
            return self.link_fixed_s, self.link_bytes_per_s
        return (
            self.link_fixed_s if self.push_fixed_s is None else self.push_fixed_s,
            self.link_bytes_per_s if self.push_bytes_per_s is None else self.push_bytes_per_s,
        )


@dataclass(frozen=True)
class TurnFacts:
    prompt_tokens: int
    reusable_tokens: int  # D's KV that matches the prompt (0: none)
    prefill_cached_tokens: int  # what P likely has in its prefix cache for this prompt
    decode_cached_tokens: int  # what D's own prefix cache likely has (for decode-local)
    decode_local_possible: bool
    decode_busy: int = 0  # streams running on that D
    # What a decode-local turn would cost the streams already on that D. None keeps today's behaviour:
    # the running batch is ``decode_busy``, the context they read is guessed from this prompt, the step
    # time is estimated from the step model, and the budget is the policy's own (none: no ITL check).
    decode_running: int | None = None  # streams in D's decode batch now (vllm:num_requests_running)
    decode_context_tokens: int | None = None  # tokens of KV those streams read per step, all together
    decode_step_ms: float | None = None  # D's step time now, as measured (its recent ITL)
    itl_budget_ms: float | None = None  # longest ITL a stream on D may see in a step that prefills this turn
    decode_kv_usage: float | None = None  # share of D's KV its running requests and pins hold (0-1)
    prefill_queue_ms: float | None = None  # how long this turn would wait at P before its prefill starts
    decode_queue_ms: float | None = None  # how long a request sent to D now would wait there (``reuse.load``)
    prefill_waiting: int = 0  # prefills at P now (``reuse.load``): about as many would queue behind this turn's
    # other decode-local turns this gateway has prefilling on that D now (sent, no first token yet), and
    # their new tokens: their chunks share D's steps with this turn's
    decode_prefills: int = 0
    decode_prefill_tokens: int = 0
    shared_gpu: bool = False  # P and D share the GPU(s): P's prefills slow D's steps too (``reuse.load.shared_gpu``)

    @property
    def running(self) -> int:
        """D's decode batch: as its metrics said (``decode_running``), else the streams counted busy there."""
        return self.decode_running if self.decode_running is not None else self.decode_busy


def prefill_s(p: CostParams, new: int, context: int) -> float:
    if new <= 0:
        return 0.0
    return max(p.prefill_floor_s, p.prefill_per_token_s * new + p.prefill_attn_s * new * (context + new / 2))


def transfer_s(p: CostParams, tokens: int, block_size: int = 16, *, push: bool = False) -> float:
    """Time to move ``tokens`` of KV: D -> P (a pull), or P -> D with ``push``."""
    if tokens <= 0:
        return 0.0
    fixed, bw = p.link(push=push)
    blocks = -(-tokens // block_size)
    return fixed + blocks * block_size * p.kv_bytes_per_token / bw


def pulled_tokens(p: CostParams, f: TurnFacts) -> int:
    """Tokens P would actually pull: what D has beyond P's own cache, unless below the threshold."""
    n = min(f.reusable_tokens, f.prompt_tokens) - f.prefill_cached_tokens
    if n <= 0 or (p.recompute_threshold > 0 and n < p.recompute_threshold):
        return 0
    return n


def prefill_work(p: CostParams, f: TurnFacts) -> dict[Action, float]:
    """P's compute for each action through P, in seconds: what it computes past its prefix cache (and, for a
    pull, past the pulled blocks). A pull's transfer is not P's compute: vLLM schedules other requests while
    one waits for its remote KV. A decode-local turn costs P nothing (left out)."""
    L = f.prompt_tokens
    hitp = min(f.prefill_cached_tokens, L - 1)
    out = {Action.RECOMPUTE: prefill_s(p, L - hitp, hitp)}
    if f.reusable_tokens > 0:
        have = hitp + pulled_tokens(p, f)
        out[Action.PULL] = prefill_s(p, L - have, have)
    return out


def estimate(p: CostParams, f: TurnFacts, block_size: int = 16) -> dict[Action, float]:
    """Estimated TTFT of each possible action, in seconds: at idle engines, plus P's and D's queues where
    the facts say them. A decode-local turn waits D's whole queue; a turn through P waits P's queue
    first, and then only for what is left of D's queue (the requests waiting on D now are scheduled
    meanwhile; those arriving later are not counted on either side). What is left is counted from P's
    queue alone, the same for a pull and a recompute: were it counted from the end of each one's P leg,
    a D queue longer than both would make them tie, and the tie go to the recompute that costs P more."""
    L = f.prompt_tokens
    queue = (f.prefill_queue_ms or 0.0) / 1e3
    dqueue = (f.decode_queue_ms or 0.0) / 1e3
    hitd = min(f.decode_cached_tokens, L - 1)
    # after P, D pulls what its own prefix cache lacks and recomputes the last prompt token
    p_to_d = transfer_s(p, L - hitd, block_size, push=True) + p.hop_s + p.prefill_floor_s

    queue += max(0.0, dqueue - queue)  # D's queue left once P's is waited: a turn through P waits that too
    work = prefill_work(p, f)
    out = {Action.RECOMPUTE: queue + p.hop_s + work[Action.RECOMPUTE] + p_to_d}
    if Action.PULL in work:
        pull = transfer_s(p, pulled_tokens(p, f), block_size)
        out[Action.PULL] = queue + p.hop_s + pull + work[Action.PULL] + p_to_d
    if f.decode_local_possible:
        out[Action.DECODE_LOCAL] = dqueue + p.hop_s + prefill_s(p, L - hitd, hitd)
        if p.decode_chunk_tokens > 0:  # spread over steps, each as long as D's decode step at least
            _, steps = step_added_s(p, f.running, L - hitd, hitd)
            out[Action.DECODE_LOCAL] += max(steps - 1, 0) * max(decode_step_now_s(p, f), p.step_base_s)
    return out


def decode_step_s(p: CostParams, running: int, context: int) -> float:
    """D's step with ``running`` streams reading ``context`` tokens of KV in all, and no prefill."""
    if running <= 0:
        return 0.0
    return (
        p.step_base_s
        + p.step_per_seq_s * running
        + p.step_per_ctx_token_s * context
        + p.prefill_per_token_s * max(0, running - p.step_free_tokens)
    )


def decode_step_now_s(p: CostParams, f: TurnFacts) -> float:
    """D's step time now, without this turn: as measured, else estimated from its batch and the context
    they read, else from this prompt's length per stream."""
    if f.decode_step_ms is not None:
        return f.decode_step_ms / 1e3
    context = f.decode_context_tokens if f.decode_context_tokens is not None else f.running * f.prompt_tokens
    return decode_step_s(p, f.running, context)


def step_added_s(
    p: CostParams, running: int, new: int, context: int, others: int = 0, others_tokens: int = 0
) -> tuple[float, int]:
    """(seconds the longest step grows by, steps it spans) when D prefills ``new`` tokens over
    ``context`` beside ``running`` decode streams: the prefill goes in chunks of what the token budget
    leaves after the streams' tokens, each adding its compute past the free tokens and its attention.
    ``others`` prefills already running on D (``others_tokens`` new tokens in all) share the steps: each
    puts a chunk (at most ``decode_chunk_tokens``) over the same context into the step first, so the
    growth is then theirs and this turn's together, over D's decode step alone."""
    if new <= 0:
        return 0.0, 0
    left = max(1, p.max_num_batched_tokens - max(running, 0))
    per = p.decode_chunk_tokens if p.decode_chunk_tokens > 0 else left
    o = min(max(others_tokens, 0), max(others, 0) * per, left - 1)  # the other prefills' tokens in a step
    chunk = max(1, left - o)
    if p.decode_chunk_tokens > 0:
        chunk = min(chunk, p.decode_chunk_tokens)
    busy = max(0, running - p.step_free_tokens)
    o_attn = o * (context + min(o, per) / 2)

    def extra(n: int, c: int) -> float:
        compute = max(0, running + n + o - p.step_free_tokens) - busy
        return p.prefill_per_token_s * compute + p.prefill_attn_s * (n * (c + n / 2) + o_attn)

    full, rest = divmod(new, chunk)
    # a chunk costs more the more context precedes it: the worst is the last full one or the remainder
    worst = max(
        extra(chunk, context + (full - 1) * chunk) if full else 0.0,
        extra(rest, context + full * chunk) if rest else 0.0,
    )
    return worst, full + (1 if rest else 0)
