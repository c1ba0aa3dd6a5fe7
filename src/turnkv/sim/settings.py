"""Settings of one simulated engine, and the ``turnkv sim`` command line that fills them."""

from __future__ import annotations

import argparse
from typing import Literal

from pydantic import BaseModel, Field

from turnkv.sim.costs import LINKS, MODEL_SHAPES, CostModel
from turnkv.sim.engine import EngineConfig
from turnkv.sim.faults import Faults


class SimSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    model: str = "sim-model"
    template: Literal["keep", "strip"] = "keep"
    chat_template: str | None = None
    thinking: bool = True
    retokenize_drift: bool = False
    prompt_tokens_details: bool = False
    # vLLM --tokens-only: /inference/v1/generate and no tokenizer (``sim.generate``)
    tokens_only: bool = False
    # turnkv's vLLM plugin on this engine: streamed generate answers end with D's handle (``sim.generate``)
    turnkv_plugin: bool = False
    # VLLM_SERVER_DEV_MODE=1: GET /server_info says the engine's whole config
    server_dev_mode: bool = False
    # the GPUs it says it computes on, as turnkv's vLLM plugin says a real engine's (``x-turnkv-plugin``)
    gpus: list[str] = Field(default_factory=list)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    faults: Faults = Field(default_factory=Faults)

    @property
    def version(self) -> str:
        return {"0.26": "0.26.0", "0.33": "0.33.0"}[self.engine.compat]


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=["prefill", "decode", "colocated", "render"], default="colocated")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument(
        "--template",
        choices=["keep", "strip"],
        default="keep",
        help="built-in chat template: keep earlier reasoning, or strip it as Qwen3 does",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (as vLLM's --chat-template)")
    p.add_argument("--vllm-compat", choices=["0.26", "0.33"], default="0.26")
    bool_flag(p, "prefix-caching", True, "local prefix caching (vLLM --enable-prefix-caching)")
    bool_flag(p, "bidirectional", True, "kv_connector_extra_config.bidirectional_kv_xfer")
    bool_flag(p, "thinking", True, "answers start with a <think> reasoning part")
    p.add_argument("--kv-recompute-threshold", type=int, default=64)
    p.add_argument("--decoder-kv-blocks-ttl", type=float, default=480.0)
    p.add_argument("--kv-lease-duration", type=float, default=30.0)
    p.add_argument("--kv-load-failure-policy", choices=["fail", "recompute"], default="fail")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=20000)
    p.add_argument("--max-model-len", type=int, default=40960)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="most prefill tokens of one request per step (0: what the token budget leaves)",
    )
    p.add_argument("--side-channel-host", default="127.0.0.1")
    p.add_argument("--side-channel-port", type=int, default=0, help="NIXL side channel port (0: any free port)")
    p.add_argument("--clock-skew", type=float, default=0.0, help="seconds added to this engine's perf_counter")
    p.add_argument(
        "--retokenize-drift",
        action="store_true",
        help="some generated id sequences re-tokenize to different ids, as with BPE",
    )
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument(
        "--tokens-only",
        action="store_true",
        help="as vLLM --tokens-only: serve /inference/v1/generate (token ids in and out), no text routes",
    )
    p.add_argument(
        "--turnkv-plugin",
        action="store_true",
        help="as an engine with turnkv's vLLM plugin: streamed generate answers end with the KV handle",
    )
    p.add_argument(
        "--server-dev-mode",
        action="store_true",
        help="as VLLM_SERVER_DEV_MODE=1: GET /server_info?config_format=json says the engine's config",
    )
    p.add_argument(
        "--gpu",
        dest="gpus",
        action="append",
        default=[],
        metavar="UUID",
        help="say this engine computes on this GPU (repeat for several), as turnkv's vLLM plugin says "
        "a real engine's in its x-turnkv-plugin header: a gateway with shared_gpu auto compares P's and D's",
    )
    p.add_argument(
        "--gpu-share-file",
        default=None,
        metavar="PATH",
        help="share one GPU's compute with the other engines given the same file (P and D on one device: "
        "each step runs at 1/k of the GPU while k of them compute); default: a GPU of its own",
    )
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("cost model")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiplies every simulated duration; 0 = free")
    g.add_argument("--link", choices=sorted(LINKS), default="host")
    g.add_argument("--link-latency-ms", type=float, default=None, help="fixed cost per KV transfer")
    g.add_argument("--link-gbps", type=float, default=None, help="KV transfer bandwidth in GB/s")
    g.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    g.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=None,
        help="per token in a step beyond --free-tokens (compute bound)",
    )
    g.add_argument("--prefill-attn-ns", type=float, default=None, help="per new token per token of context")
    g.add_argument("--free-tokens", type=int, default=None, help="tokens a step computes within its fixed cost")
    g.add_argument("--prefill-floor-ms", type=float, default=None, help="minimum duration of a step that prefills")
    g.add_argument("--decode-itl-ms", type=float, default=None, help="a step's fixed cost (one stream's ITL alone)")
    g.add_argument("--decode-per-seq-us", type=float, default=None, help="per stream in the decode batch")
    g.add_argument("--decode-ctx-ns", type=float, default=None, help="per token of context the decode batch attends to")
    g.add_argument("--api-overhead-ms", type=float, default=None)
    g.add_argument(
        "--text-us-per-token",
        type=float,
        default=None,
        help="templating and tokenizing a text prompt, per token (0: free; vLLM's render: about 2.4 us)",
    )
    add_render_arguments(p)
    f = p.add_argument_group("faults (also settable at run time: POST /_sim/faults)")
    f.add_argument("--fail-next", type=int, default=0, help="answer the next N generation requests with 500")
    f.add_argument("--delay-ms", type=float, default=0.0)
    f.add_argument("--drop-next", type=int, default=0, help="drop the next N streams mid-stream")
    f.add_argument("--drop-after-chunks", type=int, default=2)


def bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help_: str) -> None:
    dest = name.replace("-", "_")
    p.add_argument(f"--{name}", dest=dest, action="store_true", default=default, help=help_)
    p.add_argument(f"--no-{name}", dest=dest, action="store_false")


def settings_from_args(a: argparse.Namespace) -> SimSettings:
    cost_overrides = {
        k: v
        for k, v in {
            "prefill_per_token_s": None if a.prefill_us_per_token is None else a.prefill_us_per_token / 1e6,
            "prefill_floor_s": None if a.prefill_floor_ms is None else a.prefill_floor_ms / 1e3,
            "decode_base_s": None if a.decode_itl_ms is None else a.decode_itl_ms / 1e3,
            "decode_per_seq_s": None if a.decode_per_seq_us is None else a.decode_per_seq_us / 1e6,
            "decode_per_ctx_token_s": None if a.decode_ctx_ns is None else a.decode_ctx_ns / 1e9,
            "prefill_attn_s": None if a.prefill_attn_ns is None else a.prefill_attn_ns / 1e9,
            "free_tokens": a.free_tokens,
            "api_overhead_s": None if a.api_overhead_ms is None else a.api_overhead_ms / 1e3,
            "text_per_token_s": None if a.text_us_per_token is None else a.text_us_per_token / 1e6,
        }.items()
        if v is not None
    }
    costs = CostModel(
        time_scale=a.time_scale,
        link=a.link,
        model_shape=a.model_shape,
        link_fixed_s=None if a.link_latency_ms is None else a.link_latency_ms / 1e3,
        link_bytes_per_s=None if a.link_gbps is None else a.link_gbps * 1e9,
        **cost_overrides,
    )
    engine = EngineConfig(
        role=a.role,
        compat=a.vllm_compat,
        block_size=a.block_size,
        num_blocks=a.num_gpu_blocks,
        prefix_caching=a.prefix_caching,
        bidirectional=a.bidirectional,
        kv_recompute_threshold=a.kv_recompute_threshold,
        decoder_kv_blocks_ttl=a.decoder_kv_blocks_ttl,
        kv_lease_duration=a.kv_lease_duration,
        kv_load_failure_policy=a.kv_load_failure_policy,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        side_channel_host=a.side_channel_host,
        side_channel_port=a.side_channel_port,
        clock_skew_s=a.clock_skew,
        seed=a.seed,
        costs=costs,
        gpu_share_file=a.gpu_share_file,
    )
    return SimSettings(
        host=a.host,
        port=a.port,
        model=a.model,
        template=a.template,
        chat_template=a.chat_template,
        thinking=a.thinking,
        retokenize_drift=a.retokenize_drift,
        prompt_tokens_details=a.enable_prompt_tokens_details,
        tokens_only=a.tokens_only,
        turnkv_plugin=a.turnkv_plugin,
        server_dev_mode=a.server_dev_mode,
        gpus=a.gpus,
        engine=engine,
        faults=Faults(
            fail_next=a.fail_next, delay_ms=a.delay_ms, drop_next=a.drop_next, drop_after_chunks=a.drop_after_chunks
        ),
    )


def add_render_arguments(p: argparse.ArgumentParser) -> None:
    """The render role's own flags (``sim.render.render_settings_from_args`` reads them)."""
    g = p.add_argument_group("render role (--role render)")
    g.add_argument("--no-reasoning-parser", dest="reasoning_parser", action="store_false", default=True)
    g.add_argument("--no-tool-parser", dest="tool_parser", action="store_false", default=True)
    g.add_argument("--render-cores", type=int, default=1, help="calls a render service serves at once")
    g.add_argument("--render-ms", type=float, default=None, help="a render call's fixed cost")
    g.add_argument("--derender-ms", type=float, default=None, help="a non-streaming derender call's fixed cost")
    g.add_argument("--stream-derender-ms", type=float, default=None, help="a streaming derender call's fixed cost")
    g.add_argument(
        "--stream-replay-us", type=float, default=None, help="per output token a streaming derender call decodes"
    )
