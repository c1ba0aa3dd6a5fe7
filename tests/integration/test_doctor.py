"""``turnkv doctor`` against simulated engines (real processes on loopback): the measured link against the
simulator's presets and the fifth-turn suite's winners, each misconfigured pair it must refuse, and the
profile a gateway then loads."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from turnkv import launch
from turnkv.config import Settings, Timeouts
from turnkv.doctor.findings import Finding, Item, Verdict
from turnkv.doctor.run import Options, Report, diagnose
from turnkv.engine.vllm.diagnostics import vllm_diagnostics
from turnkv.sim.costs import LINKS

pytestmark = pytest.mark.integration
FAST = ("--time-scale", "0")


def start(
    procs: list[launch.Running], log_dir: Path, p: tuple[str, ...], d: tuple[str, ...], *, p_role: str = "prefill"
) -> tuple[str, str]:
    """A P and a D, started side by side (each one that started is stopped at the test's end)."""
    specs = (("prefill", p_role, p), ("decode", "decode", d))
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(launch.sim, name, role, *flags, log_dir=log_dir) for name, role, flags in specs]
    errors = [e for f in futures if (e := f.exception()) is not None]
    procs.extend(f.result() for f in futures if f.exception() is None)
    if errors:
        raise errors[0]
    return futures[0].result().url, futures[1].result().url


def doctor(p: str, d: str, options: Options | None = None, **settings: Any) -> Report:
    s = Settings(prefill=[p], decode=[d], timeouts=Timeouts(health_s=10.0), **settings)

    async def run() -> Report:
        async with vllm_diagnostics(s) as (engine, probes):
            return await diagnose(s, options or Options(sizes=(1024, 2048, 4096)), engine, probes)

    return asyncio.run(run())


def found(r: Report, item: Item, engine: str | None = None) -> list[Finding]:
    return [f for f in r.findings if f.item is item and (engine is None or f.engine == engine)]


def verdicts(r: Report, item: Item, engine: str | None = None) -> set[Verdict]:
    return {f.verdict for f in found(r, item, engine)}


def pins(url: str) -> int:
    with urllib.request.urlopen(url + "/_sim/state", timeout=10) as resp:
        return int(json.loads(resp.read())["pins"])


# link preset -> (what P reads D's blocks over, what D reads P's over, the longest history at which the
# fifth-turn suite saw recomputing win: None where a pull never won). The suite (BENCHMARKS.md,
# "Fifth-turn TTFT on the simulator", P's cache cold) had always-pull win at 16k on every link but
# `host`, and on rdma400 from 2k up.
PRESETS = {
    "host": ("host", "host", None),
    "h200-ipc": ("h200-ipc", "nvlink", 16000),
    "100gbe": ("100gbe", "100gbe", 16000),
    "rdma400": ("rdma400", "rdma400", 2000),
    "nvlink": ("nvlink", "nvlink", 16000),
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_measured_link_is_the_preset_and_the_verdict_the_fifth_turn_winner(
    procs: list[launch.Running], tmp_path: Path, preset: str
) -> None:
    p_link, d_link, wins_by = PRESETS[preset]
    p, d = start(procs, tmp_path, ("--link", p_link), ("--link", d_link))
    # at simulated speed: the host link moves 0.43 GB/s, so short prompts keep the probe to seconds
    r = doctor(p, d, Options(sizes=(512, 2048, 4096) if preset == "host" else (1024, 4096, 8192)))
    assert r.exit_status == 0, [f for f in r.findings if f.verdict is Verdict.FAIL]
    f = r.figures
    assert f is not None and f.pull is not None and f.push is not None
    assert f.pull.bytes_per_s == pytest.approx(LINKS[p_link].bytes_per_s, rel=0.15)
    assert f.push.bytes_per_s == pytest.approx(LINKS[d_link].bytes_per_s, rel=0.15)
    [pays] = found(r, Item.PULL_PAYS)
    if wins_by is None:
        assert pays.verdict is Verdict.WARN and f.break_even is None
    else:
        assert pays.verdict is Verdict.OK and f.break_even is not None and f.break_even < wins_by
    slow = verdicts(r, Item.LINK_D_TO_P)
    assert slow == ({Verdict.WARN} if preset == "host" else {Verdict.OK})
    t = r.observed.transfer
    assert t is not None and t.load.left_pinned == 0 and t.load.released > 0
    assert pins(p) == 0 and pins(d) == 0  # the probe leaves nothing pinned on either engine


def test_bidirectional_off_on_decode_blocks(procs: list[launch.Running], tmp_path: Path) -> None:
    p, d = start(procs, tmp_path, FAST, (*FAST, "--no-bidirectional"))
    r = doctor(p, d)
    assert r.exit_status == 1
    assert verdicts(r, Item.BIDIRECTIONAL, d) == {Verdict.FAIL}
    assert verdicts(r, Item.BIDIRECTIONAL, p) == {Verdict.WARN}  # no handle to try it with
    assert pins(d) == 0


def test_bidirectional_off_on_prefill_blocks(procs: list[launch.Running], tmp_path: Path) -> None:
    p, d = start(procs, tmp_path, (*FAST, "--no-bidirectional"), FAST)
    r = doctor(p, d)
    assert r.exit_status == 1
    [f] = found(r, Item.BIDIRECTIONAL, p)
    assert f.verdict is Verdict.FAIL and "bidirectional_kv_xfer" in (f.fix or "")
    assert verdicts(r, Item.BIDIRECTIONAL, d) == {Verdict.OK}
    assert pins(d) == 0 and pins(p) == 0  # D's handles given back through P all the same


def test_engines_of_different_models_block(procs: list[launch.Running], tmp_path: Path) -> None:
    p, d = start(procs, tmp_path, (*FAST, "--model", "model-a"), (*FAST, "--model", "model-b"))
    r = doctor(p, d)
    assert r.exit_status == 1
    assert verdicts(r, Item.MODELS) == {Verdict.FAIL}
    assert r.observed.transfer is None  # no pair to measure


def test_a_tokens_only_prefill_with_a_chat_only_decode(procs: list[launch.Running], tmp_path: Path) -> None:
    # P takes token ids only (no tokenizer); D (vLLM 0.26) takes no prompt ids and renders each turn itself.
    # The gateway renders on P unless told otherwise: blocking, and the fix names D. With render set to D
    # the template is audited there, and what still blocks is P itself: it refuses the prefill the
    # gateway sends (a token-id completion), which the probe's own turn shows.
    p, d = start(procs, tmp_path, (*FAST, "--tokens-only"), FAST)
    r = doctor(p, d)
    assert r.exit_status == 1
    [render] = found(r, Item.RENDER)
    assert render.verdict is Verdict.FAIL and f"render: {d}" in (render.fix or "")
    assert verdicts(r, Item.TOKENIZER, p) == {Verdict.INFO}
    fixed = doctor(p, d, render=d)
    assert verdicts(fixed, Item.RENDER) == {Verdict.OK} and verdicts(fixed, Item.TEMPLATE) == {Verdict.OK}
    [probe] = found(fixed, Item.PROBE)
    assert probe.verdict is Verdict.FAIL and "skip_tokenizer_init" in probe.summary
    assert fixed.exit_status == 1


def test_a_prefill_engine_without_a_connector_blocks(procs: list[launch.Running], tmp_path: Path) -> None:
    p, d = start(procs, tmp_path, FAST, FAST, p_role="colocated")
    r = doctor(p, d)
    assert r.exit_status == 1
    assert Verdict.FAIL in verdicts(r, Item.CONNECTOR)


def test_a_template_that_strips_reasoning(procs: list[launch.Running], tmp_path: Path) -> None:
    p, d = start(procs, tmp_path, (*FAST, "--template", "strip"), (*FAST, "--template", "strip"))
    assert verdicts(doctor(p, d), Item.TEMPLATE) == {Verdict.WARN}


def test_engines_in_dev_mode_say_their_transfer_config(procs: list[launch.Running], tmp_path: Path) -> None:
    p, d = start(procs, tmp_path, (*FAST, "--server-dev-mode"), (*FAST, "--server-dev-mode", "--no-bidirectional"))
    r = doctor(p, d, Options(measure=False))
    assert {f.data.get("role") for f in found(r, Item.CONNECTOR)} == {"kv_producer", "kv_consumer"}
    assert verdicts(r, Item.BIDIRECTIONAL, d) == {Verdict.FAIL}  # from its config: nothing was sent
    assert verdicts(r, Item.BIDIRECTIONAL, p) == {Verdict.OK}
    assert not found(r, Item.UNEXPOSED)
    assert r.observed.transfer is None


def test_the_command_gates_and_its_profile_seeds_the_gateway(procs: list[launch.Running], tmp_path: Path) -> None:
    p, d = start(procs, tmp_path, ("--link", "rdma400"), ("--link", "rdma400"))
    report, profile = tmp_path / "report.json", tmp_path / "profile.json"
    args = [
        "--prefill",
        p,
        "--decode",
        d,
        "--sizes",
        "1024,2048,4096",
        "--json",
        str(report),
        "--profile",
        str(profile),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "turnkv", "doctor", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 blocking problems" in done.stdout and "D -> P (P pulls D's KV): 45 GB/s" in done.stdout
    body = json.loads(report.read_text())
    assert body["exit_status"] == 0 and body["profile"]["pull"]["gbps"] == pytest.approx(45, rel=0.15)
    gw = launch.gateway("gateway", [p], [d], "--profile", str(profile), log_dir=tmp_path)
    procs.append(gw)
    with urllib.request.urlopen(gw.url + "/ready", timeout=10) as resp:
        priors = json.loads(resp.read())["cost_priors"]
    assert priors["source"] == "profile" and priors["profile"]["file"] == str(profile)
    assert priors["pull"]["gbps"] == pytest.approx(45, rel=0.15)

    bad = subprocess.run(
        [sys.executable, "-m", "turnkv", "doctor", "--prefill", p, "--decode", d, "--sizes", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "--sizes" in bad.stderr
