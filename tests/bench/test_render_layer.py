"""``turnkv bench render-layer``: its structure (never its timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def bench(*args: str, out: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "turnkv", "bench", "render-layer", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads((out / f"{args[0]}.json").read_text()))


def test_capacity_sizes_every_way_from_the_cost_model(tmp_path: Path) -> None:
    got = bench("capacity", "--prompts", "2000", "9000", "--rates", "10", out=tmp_path)
    rows = got["rows"]
    assert {r["prompt_tokens"] for r in rows} == {2000, 9000}
    by_way = {r["way"]: r for r in rows if r["prompt_tokens"] == 9000}
    one = by_way["vLLM streaming derender, every token"]["core_ms_per_request"]
    assert one > 100 * by_way["non-streaming"]["core_ms_per_request"]  # the render layer's quadratic trap
    local = by_way["turnkv incremental, tokenizer in process"]
    assert local["core_ms_per_request"] == by_way["non-streaming"]["core_ms_per_request"]


@pytest.mark.integration
@pytest.mark.parametrize("compat", ["0.26", "0.33"])
def test_derender_ways_all_add_up_to_the_non_streaming_answer(tmp_path: Path, compat: str) -> None:
    small = ("--prompt-tokens", "300", "--output-tokens", "120", "--itl-ms", "0")
    got = bench("derender", "--compat", compat, *small, out=tmp_path)
    ways = {w["way"]: w for w in got["ways"]}
    assert got["output_tokens"] == 120 and all(w["adds_up"] and not w["diverged"] for w in ways.values())
    assert ways["turnkv incremental, tokenizer in process"]["render_calls"] == 1
    assert ways["turnkv incremental, tokenizer in process"]["first_token_batching_wait_ms"] == 0.0
    if compat == "0.33":
        assert ways["vLLM streaming derender, 1 token a call"]["render_calls"] == 120
    else:  # no streaming derender before 0.27
        assert not any(w.startswith("vLLM streaming") for w in ways)
