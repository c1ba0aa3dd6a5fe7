"""Pure estimates of a turn's time to first token under each way of running it.

Three ways: ``recompute`` (P computes what its prefix cache lacks), ``pull`` (P pulls D's blocks
for the reusable part, then computes the rest) and ``decode_local`` (the decode engine that holds
the conversation prefills the new tokens itself: no P hop, no transfers). The parameters are
measurements (see ``reuse.estimator``), not constants; the defaults are the project's H200 host.
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


def estimate(p: CostParams, f: TurnFacts, block_size: int = 16) -> dict[Action, float]:
    """Estimated TTFT of each possible action, in seconds, at an idle engine."""
    L = f.prompt_tokens
    hitp = min(f.prefill_cached_tokens, L - 1)
    hitd = min(f.decode_cached_tokens, L - 1)
    # after P, D pulls what its own prefix cache lacks and recomputes the last prompt token
    p_to_d = transfer_s(p, L - hitd, block_size, push=True) + p.hop_s + p.prefill_floor_s
    out = {Action.RECOMPUTE: p.hop_s + prefill_s(p, L - hitp, hitp) + p_to_d}
    if f.reusable_tokens > 0:
        pulled = pulled_tokens(p, f)
        have = hitp + pulled
        out[Action.PULL] = p.hop_s + transfer_s(p, pulled, block_size) + prefill_s(p, L - have, have) + p_to_d
    if f.decode_local_possible:
        out[Action.DECODE_LOCAL] = p.hop_s + prefill_s(p, L - hitd, hitd)
    return out
