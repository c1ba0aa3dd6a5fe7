"""The vLLM plugin's rule against the simulator's vLLM 0.33 streams: two readings of 0.33's source agree.

The plugin (plugins/vllm-turnkv) adds ``kv_transfer_params`` to vLLM 0.26 stream chunks as 0.33 sends
it; the simulator's ``--vllm-compat 0.33`` streams carry it natively. Taking the key out of each 0.33
chunk and putting it back with the plugin's rewrite must give the chunk again, byte for byte. (The
plugin's own tests, which need no vLLM, are in plugins/vllm-turnkv/tests.)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.compat import protocol
from turnkv import launch
from turnkv.engine.vllm.handles import P_ONLY

PLUGIN_SRC = Path(__file__).resolve().parents[2] / "plugins" / "vllm-turnkv" / "src"
MESSAGES = [{"role": "user", "content": "Tell me about the files of this project"}]


@pytest.fixture(scope="module")
def rewrite() -> Iterator[ModuleType]:
    sys.path.insert(0, str(PLUGIN_SRC))
    try:
        import vllm_turnkv.rewrite as mod
    finally:
        sys.path.remove(str(PLUGIN_SRC))
    yield mod


@pytest.fixture(scope="module")
def engines_033(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    logs = tmp_path_factory.mktemp("plugin-rule")
    flags = ["--vllm-compat", "0.33", "--time-scale", "0", "--no-thinking"]
    p = launch.sim("rule-prefill", "prefill", *flags, log_dir=logs)
    d = launch.sim("rule-decode", "decode", *flags, log_dir=logs)
    yield p.url, d.url
    d.stop()
    p.stop()


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {}),
        ("/v1/chat/completions", {"return_token_ids": True, "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"return_token_ids": True, "stream_options": {"include_usage": True}}),
    ],
)
def test_plugin_rewrite_reproduces_033_chunks(
    rewrite: ModuleType, engines_033: tuple[str, str], path: str, extra: dict[str, Any]
) -> None:
    p, d = engines_033
    base: dict[str, Any] = {"model": "sim-model", "max_tokens": 6, "ignore_eos": True}
    base |= {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "Tell me about the files"}
    pre = protocol.send(p, "POST", path, {**base, "max_tokens": 1, "kv_transfer_params": P_ONLY})
    assert pre["status"] == 200
    got = protocol.send(
        d, "POST", path, {**base, **extra, "stream": True, "kv_transfer_params": pre["json"]["kv_transfer_params"]}
    )
    kind = "chat" if path.endswith("chat/completions") else "completion"
    payloads = [x for x in protocol.sse_payloads(got["raw"]) if x.startswith("{")]
    handles = [
        json.loads(x)["kv_transfer_params"]
        for x in payloads
        if isinstance(json.loads(x).get("kv_transfer_params"), dict)
    ]
    assert len(handles) == 1
    for x in payloads:
        bare = {k: v for k, v in json.loads(x).items() if k != "kv_transfer_params"}
        event = "data: " + json.dumps(bare, ensure_ascii=False, separators=(",", ":")) + "\n\n"
        assert rewrite.rewrite_event(event, kind, handles[0]) == f"data: {x}\n\n"
