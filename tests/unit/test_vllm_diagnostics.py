"""What the doctor reads of vLLM: /metrics (recorded from vLLM 0.26), /server_info's config, and logs."""

from __future__ import annotations

import json
from pathlib import Path

from turnkv.engine.vllm.diagnostics import cache_config, read_log, transfer_settings, transfer_totals

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.26.0"


def recorded_metrics() -> str:
    return str(json.loads((FIXTURES / "metrics.json").read_text())["steps"][0]["response"]["raw"])


def test_cache_config_from_vllm_metrics() -> None:
    c = cache_config(recorded_metrics())
    assert (c["block_size"], c["num_gpu_blocks"], c["enable_prefix_caching"]) == ("16", "140243", "True")
    assert c["gpu_memory_utilization"] == "0.25"
    assert cache_config("") == {}


def test_transfer_totals_from_vllm_metrics() -> None:
    t = transfer_totals(recorded_metrics())
    assert t is not None
    assert (t.count, t.bytes, t.failed) == (9.0, 4980736.0, 0.0)
    assert abs(t.seconds - 0.022145) < 1e-9
    empty = transfer_totals("")
    assert empty is not None and empty.count == 0.0


def test_transfer_settings_from_server_info() -> None:
    config = {
        "kv_transfer_config": {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_consumer",
            "kv_buffer_device": "cuda",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"bidirectional_kv_xfer": "false", "decoder_kv_blocks_ttl": 300},
        }
    }
    s = transfer_settings(config, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "decode", "VLLM_NIXL_SIDE_CHANNEL_PORT": 5601})
    # vLLM tests the flag for truth: the string "false" turns it on
    assert (s.connector, s.role, s.bidirectional, s.failure_policy) == (
        "NixlConnector",
        "kv_consumer",
        True,
        "recompute",
    )
    assert (s.recompute_threshold, s.decoder_ttl_s, s.lease_s, s.side_channel) == (64, 300.0, 30.0, "decode:5601")
    none = transfer_settings({"kv_transfer_config": None}, {})
    assert none.connector == ""


UCX_TCP = "\n".join(
    [
        "[1764412345.1] ucp_worker.c:1890 UCX  INFO  intra-node cfg#2 rma_am(tcp/lo)  amo_am(tcp/lo)  "
        "device(cuda_ipc/cuda)  am(tcp/lo cma/memory cuda_ipc/cuda)  ka(tcp/lo)",
        "INFO 11-29 10:00:00 [base_scheduler.py:162] Bidirectional KV transfer is enabled and the kv recompute "
        "threshold is set to 64 tokens.KV blocks on D are released after a TTL of 480 seconds.",
        "INFO 11-29 10:01:00 [metrics.py:103] KV Transfer metrics: Num successful transfers=1, Avg xfer time "
        "(ms)=1847.655, P90 xfer time (ms)=1847.655, Avg post time (ms)=0.558, P90 post time (ms)=0.558, Avg MB "
        "per transfer=876.75, Throughput (MB/s)=474.5, Avg number of descriptors=40",
    ]
)


def test_a_log_of_ucx_on_tcp() -> None:
    f = read_log(UCX_TCP)
    assert f.transports == {"tcp", "cuda_ipc", "cma"}
    assert f.remote_access == frozenset() and f.emulated
    assert f.settings == {
        "bidirectional_kv_xfer": "true",
        "kv_recompute_threshold": "64",
        "decoder_kv_blocks_ttl": "480",
    }
    assert len(f.transfer_lines) == 1 and "Throughput (MB/s)=474.5" in f.transfer_lines[0]


def test_a_log_with_zero_copy_reads() -> None:
    f = read_log("UCX INFO intra-node cfg#1 rma_bw(cuda_ipc/cuda) am(tcp/lo)\n")
    assert f.remote_access == {"cuda_ipc"} and not f.emulated
    assert read_log("nothing here").transports == frozenset()
