"""Each example in examples/ runs against the simulated stack with one command, sends no conversation
id, and turnkv reuses the KV of its later model calls."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
# example -> (the package it needs, where its conversation is found, the outcomes of later calls, how
# many later calls may start a new history)
# run.py runs the gateway at its defaults (the adaptive policy: a later call's few new tokens are computed on
# D, decode_local, where that is the fastest), with Redis and simulated time
EXAMPLES = {
    "openai_chat": ("openai", {"digest"}, {"full", "decode_local"}, 0),
    "openai_responses": ("openai", {"digest", "response"}, {"full", "decode_local"}, 0),
    "curl": ("openai", {"digest", "response"}, {"full", "decode_local"}, 0),
    "agents_sdk": ("agents", {"digest"}, {"full", "decode_local"}, 0),
    "pydantic_ai": ("pydantic_ai", {"digest"}, {"full", "decode_local"}, 0),
    # these two do not send the answer back as the model gave it (reasoning dropped; tool calls as
    # text): the history up to that answer is reused
    "langgraph": ("langgraph", {"digest"}, {"full", "partial", "decode_local"}, 0),
    # smolagents, when a task reaches max_steps, asks for a final answer under another system prompt:
    # a new history, once per task at most (3 tasks)
    "smolagents": ("smolagents", {"digest"}, {"full", "partial", "decode_local"}, 3),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_reuses_kv_with_no_configuration(name: str) -> None:
    package, sources, outcomes, new_histories = EXAMPLES[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install -e '.[examples]'")
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "run.py"), name, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    turns = summary["turns"]
    assert summary["calls"] >= 3 and len(turns) == summary["calls"], run.stdout[-3000:]
    assert {t["conversation_source"] for t in turns} <= sources
    assert turns[0]["reason"] == "no_record"
    new = [t for t in turns[1:] if (t["outcome"], t["reason"]) == ("none", "no_record")]
    later = [t for t in turns[1:] if t not in new]
    assert len(new) <= new_histories, [(t["outcome"], t["reason"]) for t in turns]
    assert {t["outcome"] for t in later} <= outcomes, [(t["outcome"], t["reason"]) for t in later]
    # reused: D's KV matched (a pull), or P's prefix cache held it (D's KV written back to P after the last turn)
    assert all(max(t["matched_tokens"], t.get("tokens_cached") or 0) > t["prompt_tokens"] // 2 for t in later), later
