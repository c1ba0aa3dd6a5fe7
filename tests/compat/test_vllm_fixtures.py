"""The simulator held to real vLLM: recorded vLLM responses replayed against ``turnkv sim``, compared by shape.

Fixtures live in tests/fixtures/vllm/<vLLM version>/<case>.json, recorded on the GPU host by
gpu/record_fixtures.py (format: tests/fixtures/vllm/README.md). Each case's steps are sent, in the
recorded order, to a simulated prefill and decode engine started with the flags the recording names
(``source.sim_flags``, e.g. ``--vllm-compat 0.26``), and every response is compared with the
recorded one: status, content type, the same JSON key sets in the same order, the same JSON types,
enum-like values, SSE framing, and the sequence of stream chunk shapes (tests/compat/protocol.py).

Without recorded fixtures the tests skip. The 0.26.0 set was recorded on one H200 on 2026-11-29
(`bash gpu/session.sh A`, gpu/README.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compat import protocol
from turnkv import launch

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SOURCES = {"vllm": FIXTURES / "vllm"}
PLUGIN_SRC = ROOT / "plugins" / "vllm-turnkv" / "src"


def _versions(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and protocol.load_cases(d)) if root.is_dir() else []


def _params() -> list[Any]:
    out: list[Any] = []
    for label, root in SOURCES.items():
        versions = _versions(root)
        if not versions:
            why = (
                f"no fixtures recorded under {root.relative_to(ROOT)} yet (gpu/record_fixtures.py on the GPU "
                "host: gpu/README.md)"
            )
            out.append(pytest.param(label, None, None, id=f"{label}-none", marks=pytest.mark.skip(reason=why)))
            continue
        for v in versions:
            for case in sorted(protocol.load_cases(v), key=lambda c: (c.get("seq", 0), c["case"])):
                out.append(pytest.param(label, v.name, case, id=f"{label}-{v.name}-{case['case']}"))
    return out


class SimPair:
    """A simulated prefill and decode engine, started once per (source, version)."""

    def __init__(self, flags: list[str], log_dir: Path) -> None:
        self.p = launch.sim("compat-prefill", "prefill", *flags, log_dir=log_dir)
        try:
            self.d = launch.sim("compat-decode", "decode", *flags, log_dir=log_dir)
        except Exception:
            self.p.stop()
            raise

    def urls(self, replay: dict[str, Any] | None) -> dict[str, str]:
        urls = {"prefill": self.p.url, "decode": self.d.url, "decode_plugin": self.d.url}
        for role, target in ((replay or {}).get("engines") or {}).items():
            urls[role] = urls[target]
        return urls

    def stop(self) -> None:
        self.d.stop()
        self.p.stop()


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, ...], SimPair]]:
    started: dict[tuple[str, ...], SimPair] = {}
    yield started
    for pair in started.values():
        pair.stop()


def _pair(
    sims: dict[tuple[str, ...], SimPair],
    case: dict[str, Any],
    label: str,
    version: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> SimPair:
    flags = tuple(case["source"]["sim_flags"])
    key = (label, version, *flags)
    if key not in sims:
        sims[key] = SimPair(list(flags), tmp_path_factory.mktemp(f"compat-{label}-{version}"))
    return sims[key]


@pytest.mark.parametrize(("label", "version", "case"), _params())
def test_simulator_matches_recording(
    label: str,
    version: str,
    case: dict[str, Any],
    sims: dict[tuple[str, ...], SimPair],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    replay = case.get("replay") or {}
    pair = _pair(sims, case, label, version, tmp_path_factory)
    results = protocol.run_steps(case, pair.urls(replay), timeout_s=60)
    problems: list[str] = []
    for step in case["steps"]:
        rec = step["response"]
        got = results[step["name"]]
        for p in protocol.compare_response(rec, got, drop_stream_keys=tuple(replay.get("drop_stream_keys") or ())):
            problems.append(f"{step['name']} {step.get('method', 'POST')} {step['path']}: {p}")
    assert not problems, f"{case['case']} ({case['description']}):\n  " + "\n  ".join(problems)


def _plugin_cases() -> list[Any]:
    out = [
        pytest.param(v.name, c, id=f"{v.name}-{c['case']}")
        for v in _versions(SOURCES["vllm"])
        for c in protocol.load_cases(v)
        if c["case"].startswith("plugin_")
    ]
    return out or [
        pytest.param(
            None,
            None,
            id="none",
            marks=pytest.mark.skip(reason="no plugin fixtures recorded yet (gpu/record_fixtures.py on the GPU host)"),
        )
    ]


@pytest.mark.parametrize(("version", "case"), _plugin_cases())
def test_recorded_plugin_streams_follow_the_plugin_rule(version: str, case: dict[str, Any]) -> None:
    """vLLM 0.26 with the plugin, as recorded, equals the plugin's pure rule applied to the chunks with
    the key taken out: the key (null, or the handle on the finish chunk) exactly where 0.33 has it."""
    sys.path.insert(0, str(PLUGIN_SRC))
    try:
        from vllm_turnkv.rewrite import rewrite_event
    finally:
        sys.path.remove(str(PLUGIN_SRC))
    resp = case["steps"][-1]["response"]
    if resp["kind"] != "sse":
        assert "kv_transfer_params" in (resp.get("json") or {})  # non-streaming: vLLM's own field
        return
    kind = "completion" if case["steps"][-1]["path"] == "/v1/completions" else "chat"
    payloads = protocol.sse_payloads(resp["raw"])
    final = [
        json.loads(p)["kv_transfer_params"]
        for p in payloads
        if p.startswith("{")
        and "kv_transfer_params" in json.loads(p)
        and isinstance(json.loads(p)["kv_transfer_params"], dict)
    ]
    assert len(final) == 1, "exactly one chunk carries D's handle"
    for p in payloads:
        if not p.startswith("{"):
            continue
        obj = json.loads(p)
        bare = {k: v for k, v in obj.items() if k != "kv_transfer_params"}
        event = "data: " + json.dumps(bare, ensure_ascii=False, separators=(",", ":")) + "\n\n"
        expected = rewrite_event(event, kind, final[0])
        assert json.loads(expected[6:-2]) == obj and list(json.loads(expected[6:-2])) == list(obj), p[:300]
