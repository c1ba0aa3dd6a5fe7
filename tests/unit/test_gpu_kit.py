"""gpu/'s kit as a GPU host meets it: the scripts parse, every step gpu/session.sh runs is in gpu/README.md,
and the model folders gpu/make_model.py writes have the shape and chat templates the rest relies on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from turnkv.sim.costs import kv_bytes_per_token

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "gpu"
sys.path.insert(0, str(GPU))

import make_model  # noqa: E402


@pytest.mark.parametrize("script", sorted(p.relative_to(ROOT).as_posix() for p in GPU.rglob("*.sh")))
def test_the_shell_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", script], cwd=ROOT, check=True)


def test_every_step_of_a_session_is_documented() -> None:
    cases = re.findall(r"^  ([A-Z][0-9]?(?:\|[A-Z][0-9]?)*)\)", (GPU / "session.sh").read_text(), re.M)
    parts = {p for case in cases for p in case.split("|")}
    assert parts >= {"A", "B1", "L1", "G1", "R1", "P1"}, parts  # the pattern still finds them
    readme = (GPU / "README.md").read_text()
    assert sorted(p for p in parts if f"`{p}`" not in readme) == []


def test_the_8b_folder_is_the_shape_the_simulator_and_the_gateway_price() -> None:
    cfg = make_model.config("8b")
    per_token = 2 * int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"]) * int(cfg["head_dim"]) * 2
    assert per_token == kv_bytes_per_token("qwen3-8b") == 147456  # Settings.kv_bytes_per_token's default


def _render(folder: Path, messages: list[dict[str, str]]) -> str:
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    return jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)


def test_keep_keeps_earlier_reasoning_and_strip_drops_it(tmp_path: Path) -> None:
    history = [
        {"role": "user", "content": "plan the day"},
        {"role": "assistant", "content": "museum first", "reasoning_content": "it opens at nine"},
        {"role": "user", "content": "and then?"},
    ]
    for t in ("keep", "strip"):
        make_model.write(str(tmp_path / t), "tiny", t, tokenizer=False)
    keep, strip = _render(tmp_path / "keep", history), _render(tmp_path / "strip", history)
    assert "<think>\nit opens at nine\n</think>" in keep and "it opens at nine" not in strip
    assert strip == keep.replace("<think>\nit opens at nine\n</think>\n\n", "")
    assert keep.endswith("<|im_start|>assistant\n")
