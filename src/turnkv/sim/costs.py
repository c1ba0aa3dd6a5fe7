"""How long simulated work takes: engine steps (decode and prefill together), KV transfers, the API hop.

One engine step is one forward pass over every token scheduled into it, as in vLLM's continuous
batching with chunked prefill: the running streams' decode tokens and the prefill chunks that fit
in what is left of ``max_num_batched_tokens``. Its duration (``CostModel.step_s``) is

    step = STEP_BASE_S                                       one pass over the weights (memory bound)
         + DECODE_PER_SEQ_S x decode batch                    per running stream (sampling, bookkeeping)
         + DECODE_PER_CTX_TOKEN_S x context the batch reads   attention over the streams' KV
         + PREFILL_PER_TOKEN_S x max(0, tokens - FREE_TOKENS) compute, once the step is compute bound
         + PREFILL_ATTN_S x sum of new x (context + new/2)    the prefill chunks' attention

where ``tokens`` is decode tokens plus prefill tokens in the step. So a running stream's inter-token
latency is the step time, and a prefill scheduled beside it (a decode-local turn, a colocated
engine's new prompt) lengthens that step for every stream; a prefill longer than the token budget is
split over several steps, each longer. A lone prefill of N tokens is the same formula with no decode
batch. The constants are priors for the Qwen3-8B shape on one H200 (vLLM 0.26): the prefill terms
from our own run there (a cold prefill through P took 113-121 ms for 4.2k tokens and 547-603 ms for
16.4k: 8 ms + 23.5 us/token past the first 128 + 1.2 ns per token per token of context fits both),
the decode terms from published vLLM figures for an 8B model on one H100/H200 (~8 ms ITL at a small
batch) and the
KV read rate (144 KiB per token of context at ~3 TB/s effective). ``gpu/step_time.py`` measures
decode step time against prefill tokens in the batch and batch size on real vLLM, and
``gpu/fit_step_time.py`` fits these constants from it. Its first run (2026-12-01, one engine alone on
the H200, vLLM 0.26 with ``--enforce-eager`` as gpu/ runs it; BENCHMARKS.md, "Decode step time on one H200")
found a step of
23.8 ms + 15.4 us per stream + 12.4 ns per token of context read + 14.8 us per token past 512 + 1.235 ns
of prefill attention (rms 13.6 ms over 248 samples: the eager engine's steps are noisy). The defaults
stay the priors, which every simulator benchmark so far used; ``turnkv sim --decode-itl-ms 23.797
--decode-per-seq-us 15.36 --decode-ctx-ns 12.40 --prefill-us-per-token 14.78 --free-tokens 512
--prefill-attn-ns 1.235`` runs the fit (an eager engine: about 3x the priors' ITL at a small batch).

Links: NIXL moved KV at 0.36-0.50 GB/s over TCP with about 2 ms fixed cost per transfer on our H200
host; with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` the same host moved P->D at 172-352 GB/s and D->P at
5-21 GB/s (preset ``h200-ipc``, the slower direction). Every duration is multiplied by
``time_scale``; 0 makes the engine free, for gateway-overhead runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

KIB = 1024


@dataclass(frozen=True)
class Link:
    """A KV transfer path: a fixed cost per transfer plus bytes over bandwidth."""

    name: str
    fixed_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s


LINKS = {
    # Measured on the project's H200 host: UCX ends up on TCP.
    "host": Link("host", fixed_s=0.002, bytes_per_s=0.43e9),
    # The same host with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (cuda_ipc GET enabled): D->P reads measured.
    "h200-ipc": Link("h200-ipc", fixed_s=0.002, bytes_per_s=20.0e9),
    "100gbe": Link("100gbe", fixed_s=0.010, bytes_per_s=11.0e9),
    "rdma400": Link("rdma400", fixed_s=0.005, bytes_per_s=45.0e9),
    "nvlink": Link("nvlink", fixed_s=0.002, bytes_per_s=300.0e9),
}

MODEL_SHAPES = {  # layers, kv heads, head dim (bf16)
    "qwen3-8b": (36, 8, 128),
    "llama3-8b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "qwen3-32b": (64, 8, 128),
}


def kv_bytes_per_token(shape: str) -> int:
    layers, kv_heads, head_dim = MODEL_SHAPES[shape]
    return 2 * layers * kv_heads * head_dim * 2


# The step model's priors (see the module docstring); ``CostModel`` takes each as a field.
STEP_BASE_S = 0.008
DECODE_PER_SEQ_S = 0.00005
DECODE_PER_CTX_TOKEN_S = 50e-9
PREFILL_PER_TOKEN_S = 23.5e-6
FREE_TOKENS = 128
PREFILL_ATTN_S = 1.2e-9


class CostModel(BaseModel):
    """Engine timing parameters. Times in seconds before ``time_scale`` is applied."""

    time_scale: float = Field(1.0, ge=0)
    decode_base_s: float = Field(STEP_BASE_S, ge=0, description="a step's fixed cost: the ITL of one stream alone")
    decode_per_seq_s: float = Field(DECODE_PER_SEQ_S, ge=0, description="per stream in the decode batch")
    decode_per_ctx_token_s: float = Field(
        DECODE_PER_CTX_TOKEN_S, ge=0, description="per token of context the decode batch attends to"
    )
    prefill_per_token_s: float = Field(
        PREFILL_PER_TOKEN_S, ge=0, description="per token in the step beyond free_tokens (compute bound)"
    )
    free_tokens: int = Field(FREE_TOKENS, ge=0, description="tokens a step computes within its fixed cost")
    prefill_attn_s: float = Field(PREFILL_ATTN_S, ge=0, description="per new token per token of context")
    prefill_floor_s: float = Field(0.0, ge=0, description="minimum duration of a step that prefills (0: none)")
    api_overhead_s: float = Field(0.003, ge=0, description="HTTP, templating and scheduling per request")
    text_per_token_s: float = Field(
        0.0,
        ge=0,
        description="per prompt token an engine templates and tokenizes itself (a text prompt; 0: free). vLLM "
        "0.34's render took 2.42 us a token on 2 cores (``sim.render.RenderCosts``)",
    )
    link: str = "host"
    link_fixed_s: float | None = None
    link_bytes_per_s: float | None = None
    model_shape: str = "qwen3-8b"

    def scaled(self, seconds: float) -> float:
        return seconds * self.time_scale

    def step_s(self, decode_batch: int, decode_context: int, chunks: Sequence[tuple[int, int]] = ()) -> float:
        """One engine step: ``decode_batch`` streams reading ``decode_context`` tokens of KV in all, and
        prefill ``chunks`` of (new tokens, tokens before them). 0 for an empty step."""
        new = sum(n for n, _ in chunks if n > 0)
        if decode_batch <= 0 and new <= 0:
            return 0.0
        t = (
            self.decode_base_s
            + self.decode_per_seq_s * max(decode_batch, 0)
            + self.decode_per_ctx_token_s * max(decode_context, 0)
            + self.prefill_per_token_s * max(0, max(decode_batch, 0) + new - self.free_tokens)
            + self.prefill_attn_s * sum(n * (c + n / 2) for n, c in chunks if n > 0)
        )
        return max(t, self.prefill_floor_s) if new > 0 else t

    def prefill_s(self, new: int, context: int) -> float:
        """A prefill of ``new`` tokens over ``context`` on an engine running nothing else (one step)."""
        return self.step_s(0, 0, ((new, context),))

    def decode_s(self, batch: int, context: int = 0) -> float:
        """A decode-only step of ``batch`` streams reading ``context`` tokens of KV in all."""
        return self.step_s(batch, context)

    def transfer_link(self) -> Link:
        base = LINKS[self.link]
        return Link(
            base.name,
            base.fixed_s if self.link_fixed_s is None else self.link_fixed_s,
            base.bytes_per_s if self.link_bytes_per_s is None else self.link_bytes_per_s,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_shape)
