"""How long simulated work takes: prefill, decode steps, KV transfers and the API hop.

Defaults describe the Qwen3-8B shape on one H200, recalibrated on 2026-11-29 from our own run of
vLLM 0.26 + NIXL there (BENCHMARKS.md, "Real vLLM on one H200"): a cold prefill through P took
113-121 ms for 4.2k tokens and 547-603 ms for 16.4k (25 us/token plus 1.2 ns per token per token
of context fits both), NIXL moved KV at 0.36-0.50 GB/s over TCP with about 2 ms fixed cost per
transfer; with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` the same host moved P->D at 172-352 GB/s and
D->P at 5-21 GB/s (preset ``h200-ipc``, the slower direction). The decode ITL (~8 ms plus a
per-sequence increment) and the 10 ms floor are from ../shared/reference/performance-anchors.md.
Every duration is multiplied by ``time_scale``; 0 makes the engine free, for gateway-overhead runs.
"""

from __future__ import annotations

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


class CostModel(BaseModel):
    """Engine timing parameters. Times in seconds before ``time_scale`` is applied."""

    time_scale: float = Field(1.0, ge=0)
    prefill_floor_s: float = Field(0.010, ge=0, description="minimum duration of a step that prefills")
    prefill_per_token_s: float = Field(25e-6, ge=0)
    prefill_attn_s: float = Field(1.2e-9, ge=0, description="per new token per token of context")
    decode_base_s: float = Field(0.008, ge=0, description="ITL of a decode step with one sequence")
    decode_per_seq_s: float = Field(0.00005, ge=0)
    api_overhead_s: float = Field(0.003, ge=0, description="HTTP, templating and scheduling per request")
    link: str = "host"
    link_fixed_s: float | None = None
    link_bytes_per_s: float | None = None
    model_shape: str = "qwen3-8b"

    def scaled(self, seconds: float) -> float:
        return seconds * self.time_scale

    def prefill_s(self, new: int, context: int) -> float:
        if new <= 0:
            return 0.0
        t = self.prefill_per_token_s * new + self.prefill_attn_s * new * (context + new / 2)
        return max(self.prefill_floor_s, t)

    def decode_s(self, batch: int) -> float:
        return 0.0 if batch <= 0 else self.decode_base_s + self.decode_per_seq_s * batch

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
