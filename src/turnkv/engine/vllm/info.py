"""What vLLM's ``/metrics`` and ``/version`` say, as engine-neutral readings.

Metrics: the process start time (a restart), running and waiting requests, KV usage, prompt and
generated tokens computed (work done: an engine whose totals move is busy, not stuck), prefix-cache
hits and settings, KV capacity (``vllm:cache_config_info``: num_gpu_blocks x block_size) and the NIXL
transfer totals (for the link estimate); the totals of three latency histograms, present in every vLLM
from 0.26 to 0.33: ``vllm:inter_token_latency_seconds`` (D's step time as its streams see it; older
releases called it ``vllm:time_per_output_token_seconds``), ``vllm:request_queue_time_seconds`` (how long
requests waited to be scheduled) and ``vllm:request_prefill_time_seconds`` (how long their prefill took).
Versions: from 0.32 a chat request takes the prompt as
``kv_transfer_params.prompt_token_ids``; from 0.33 (or with turnkv's plugin, which says so in its
``x-turnkv-plugin`` header) streams end with D's handle.
"""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from turnkv.engine.base import EngineInfo, Histo, LoadSample, Transfers

log = logging.getLogger("turnkv.engine.vllm")
PLUGIN_HEADER = "x-turnkv-plugin"  # set by plugins/vllm-turnkv: "<version>; streams=chat,completions; gpus=GPU-..."
_PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")  # work done: moving means busy
_SUMMED = (
    *_PROGRESS,
    "process_start_time_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum",
)
# histogram -> the names of its totals, newest first (a later name wins where an engine reports two)
_HISTOS = {
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "queue_time": ("vllm:request_queue_time_seconds",),
    "prefill_time": ("vllm:request_prefill_time_seconds",),
}
_HISTO_TOTALS = frozenset(f"{n}{suffix}" for names in _HISTOS.values() for n in names for suffix in ("_sum", "_count"))


def version_tuple(v: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (v or "").split(".")[:2])
    except ValueError:
        return ()


def plugin_lists(value: str) -> dict[str, frozenset[str]]:
    """The lists the plugin's header carries (``streams``, ``gpus``), by key; {} where it is absent."""
    out: dict[str, frozenset[str]] = {}
    for part in value.split(";")[1:]:
        key, _, val = part.partition("=")
        out[key.strip()] = frozenset(v.strip() for v in val.split(",") if v.strip())
    return out


def engine_info(version: str | None, plugin: str, *, base: str, decode: bool) -> EngineInfo:
    """What a vLLM version (and turnkv's plugin, when installed) means for turnkv."""
    lists = plugin_lists(plugin)
    streams = version_tuple(version) >= (0, 33) or "chat" in lists.get("streams", ())
    if not streams and decode:
        log.warning(
            "instance.no_stream_handles url=%s version=%s: streamed turns get no KV handle and run as "
            "plain P/D, and D still pins their blocks for decoder_kv_blocks_ttl; install the turnkv "
            "vLLM plugin (plugins/vllm-turnkv) or use vLLM >= 0.33",
            base,
            version,
        )
    return EngineInfo(
        version=version,
        stream_handles=True if streams else None,
        takes_prompt_ids=version_tuple(version) >= (0, 32),
        gpus=lists.get("gpus", frozenset()),
    )


def load_sample(text: str) -> LoadSample | None:
    """One reading of vLLM's Prometheus text; None when it cannot be parsed."""
    values: dict[str, float] = {}
    caching_off = False
    block_size: int | None = None
    capacity: int | None = None
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in _SUMMED or s.name in _HISTO_TOTALS:
                    values[s.name] = values.get(s.name, 0.0) + float(s.value)
                elif s.name == "vllm:cache_config_info":
                    labels = s.labels
                    caching_off = caching_off or labels.get("enable_prefix_caching") == "False"
                    bs, blocks = labels.get("block_size"), labels.get("num_gpu_blocks")
                    if bs and bs.isdigit():
                        block_size = int(bs)
                        if blocks and blocks.isdigit():
                            capacity = int(blocks) * int(bs)
    except ValueError:
        return None
    count = values.get("vllm:nixl_xfer_time_seconds_count")
    transfers = (
        None
        if count is None
        else Transfers(
            count,
            values.get("vllm:nixl_bytes_transferred_sum", 0.0),
            values.get("vllm:nixl_xfer_time_seconds_sum", 0.0),
        )
    )
    work = [values[k] for k in _PROGRESS if k in values]
    return LoadSample(
        epoch=values.get("process_start_time_seconds"),
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
        prefix_cache_hits=values.get("vllm:prefix_cache_hits_total"),
        prefix_caching_off=caching_off,
        block_size=block_size,
        capacity_tokens=capacity,
        transfers=transfers,
        tokens_computed=sum(work) if work else None,
        itl=_histo(values, "itl"),
        queue_time=_histo(values, "queue_time"),
        prefill_time=_histo(values, "prefill_time"),
    )


def _histo(values: dict[str, float], key: str) -> Histo | None:
    for name in _HISTOS[key]:
        count = values.get(f"{name}_count")
        if count is not None:
            return Histo(values.get(f"{name}_sum", 0.0), count)
    return None
