#!/usr/bin/env python3
"""Many streamed conversations at once, in waves, per serving mode: decode memory under load, and goodput.

Engines: gpu/engines.py ``pair8b`` (P :8100, D :8200 with the turnkv plugin, 0.42 of the H200 each),
started once (or found running) and kept across modes; ``--p-cache off`` restarts P only. Modes, in
the order given (``--modes``):
* ``plain``: through a turnkv gateway without a conversation id: vLLM's P/D, each turn recomputed on P
  (or served from P's prefix cache); the gateway gives D's unused handle back at once;
* ``turnkv``: turnkv at its defaults as agents call it, without a conversation id (the gateway finds each
  conversation from its history; write-back, ``shared_gpu: auto``);
* ``turnkv-no-write-back``: the same with ``write_back.mode: off`` (handles kept pinned or let go);
* ``adaptive``: turnkv's adaptive policy (``X-Session-ID``), ``shared_gpu`` left at ``auto`` (the default): with
  the plugin on both engines the gateway finds they share the GPU;
* ``adaptive-separate``: the same told P and D do not share it (``shared_gpu: false``; what ``auto`` gave
  before P had the plugin);
* ``adaptive-pull``: the same with decode-local off (``policy.params.decode_local: false``);
* ``adaptive-shared``: the same told that P and D share the GPU (the setting ``shared_gpu: true``), as
  they do here: the ITL checks then refuse decode-local only where P would prefill less than D (``auto``
  finds the same where both engines have the plugin);
* ``adaptive-first``: adaptive with first turns on D allowed while prefills wait at P
  (``policy.params.decode_local_first: true``);
* ``vllm-multiturn``: the gateway as vLLM's multi-turn proxy (policy ``vllm-multiturn``: every later turn
  hands P the previous handle, unchecked, and P pulls it; never decode-local), a baseline for goodput;
* ``colocated``: straight to D, no gateway: D prefills and decodes each turn itself;
* ``pd-direct`` (not in the default list): the client runs vLLM's P/D handshake itself. With
  ``bidirectional_kv_xfer`` on, D then pins every turn's blocks for ``decoder_kv_blocks_ttl`` and
  nothing releases them: it fills D for 8 minutes and spoils every later mode. Run it last, if at all.

Per mode, one gateway (a fresh one per mode, the same for all its waves) and ``--waves`` waves (two by
default) of the same workload (``turnkv bench``'s load generator, imported): N conversations started at
once, each its own system prompt (a seed per part, mode and wave, so no prefix is shared with an earlier
wave or mode), ``--turns`` turns of ``--user-tokens`` new words and ``--answer-tokens`` answer tokens
(``ignore_eos``), an exponential think time of mean ``--think-time-s``; each wave starts the moment the
one before it ended. Words are ones that are one token each on the engine's tokenizer, and answers are
restricted to them (``allowed_token_ids``) so that each answer re-tokenizes exactly, as a real model's
mostly does. Every request has a client deadline (``--request-timeout-s``): a miss is counted as hung.

A sweep (goodput on the GPU): ``--conversations 8,16,32`` runs the waves at each count in
turn, smallest first, within each mode (one gateway for them all). Each wave also says its goodput as
``vllm bench serve --goodput`` counts it for a closed loop: the turns that met both SLOs
(``--slo-ttft-ms``, ``--slo-tpot-ms``; ``turnkv.bench.goodput``) per second of the wave's wall time,
the share that met them (attainment), and TPOT p50/p99.

Meanwhile a thread (``load_metrics``) reads D's, P's and the gateway's /metrics every ``--sample-s`` (D's KV
usage, running and waiting requests; the gateway's pinned bytes, budget and capacity), at most one sample
per interval for the time budget. Written to OUT/load_<label>.json after every wave: per mode and wave,
hung/failed/unsent turns, TTFT p50/p99 for turn 1 and for later turns (and per turn), ITL and latency
percentiles, turnkv's decisions, NIXL transfers, the gateway's counters (releases by why, deadline misses,
captures); per mode, the timeline, the gateway log's turn events (outcome, reason, capture) and its
warnings, D's KV usage at rest; and each request as [start s, turn, TTFT ms, latency ms, 0 ok | 1 deadline |
2 failed], a few kB.

``--time-budget-s`` bounds everything from this script's start: a mode starts only if its estimate
(the workload model below, scaled by how the earlier waves of this run compared with theirs) fits,
and a wave still running at the end is cut (its finished requests kept, the cut said). The file is
written whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import devlib
import engines
from load_metrics import (
    D_SERIES,
    GW_SERIES,
    Sampler,
    counter_delta,
    gateway_counters,
    gateway_log_summary,
    gpus_told,
    sums,
    timeline,
)

if devlib.backend() == "vllm":  # turnkv's dependencies vLLM lacks, and an offline vLLM install, where set up
    sys.path += [p for p in (devlib.GATEWAY_SITE, devlib.VLLM_SITE) if p]

from turnkv.bench.client import Target
from turnkv.bench.goodput import Slo, meets, point_stats
from turnkv.bench.records import RequestRecord
from turnkv.bench.runner import run_load
from turnkv.bench.stats import percentile
from turnkv.bench.workload import Conversation, WorkloadSpec

GATEWAY_PORT = 8902
DEFAULT_MODES = "plain,adaptive,adaptive-pull,colocated"
SWEEP_MODES = "plain,vllm-multiturn,adaptive,adaptive-pull,colocated"
MAX_REQUEST_ROWS = 3000  # per mode


@dataclass(frozen=True)
class Mode:
    name: str
    gateway: bool
    session: bool  # send X-Session-ID
    history: bool = False  # without X-Session-ID, the gateway finds each conversation from its history
    policy: str = "adaptive"
    params: tuple[tuple[str, Any], ...] = ()
    settings: tuple[tuple[str, Any], ...] = ()  # the gateway's own (top-level settings)


MODES = {
    "plain": Mode("plain", gateway=True, session=False),
    "adaptive": Mode("adaptive", gateway=True, session=True),
    "turnkv": Mode("turnkv", gateway=True, session=False, history=True),
    "turnkv-no-write-back": Mode(
        "turnkv-no-write-back", gateway=True, session=False, history=True, settings=(("write_back", {"mode": "off"}),)
    ),
    "adaptive-pull": Mode("adaptive-pull", gateway=True, session=True, params=(("decode_local", False),)),
    "vllm-multiturn": Mode("vllm-multiturn", gateway=True, session=True, policy="vllm-multiturn"),
    # P and D share the GPU here: the policy told so (its ITL checks then refuse only what P would compute less of)
    "adaptive-shared": Mode("adaptive-shared", gateway=True, session=True, settings=(("shared_gpu", True),)),
    "adaptive-separate": Mode("adaptive-separate", gateway=True, session=True, settings=(("shared_gpu", False),)),
    "adaptive-first": Mode("adaptive-first", gateway=True, session=True, params=(("decode_local_first", True),)),
    "colocated": Mode("colocated", gateway=False, session=False),
    "pd-direct": Mode("pd-direct", gateway=False, session=False),
}


# -- the workload's expected duration ------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The figures the estimate uses (the 8b shape on the H200, P and D sharing it)."""

    prefill_tps: float = 35_000.0  # P's (or D's) prefill, tokens/s
    step_s: float = 0.030  # one decode step with up to 32 streams
    kv_tokens: int = 300_000  # KV capacity of one engine at 0.42 of the H200 (144 KiB per token)
    kv_bytes_per_token: int = 147_456
    pull_bytes_per_s: float = 20e9  # D -> P over CUDA IPC GET (5-34 GB/s measured)


def estimate_wave_s(
    n: int,
    turns: int,
    system: int,
    user: int,
    answer: int,
    think: float,
    *,
    mode: str,
    p_cache: bool,
    shape: Shape = Shape(),
) -> float:
    """One wave: each turn's prefill (all N conversations queue on one engine: the whole prompt, or only
    the new part where a cache or a pull holds the rest and the N contexts fit an engine's KV), then
    its answer (in rounds where N contexts do not fit D at once), then the think time. adaptive-pull
    pulls every later turn's history from D; adaptive runs it decode-local from D's prefix cache."""
    total = 0.0
    for k in range(1, turns + 1):
        ctx = system + k * user + (k - 1) * answer
        fits = n * ctx <= shape.kv_tokens
        pull = k > 1 and mode == "adaptive-pull"
        reuse = pull or (k > 1 and fits and (p_cache or mode not in ("plain", "pd-direct")))
        prefill = n * ((user + answer) if reuse else ctx) / shape.prefill_tps
        if pull:
            prefill += n * (ctx - user) * shape.kv_bytes_per_token / shape.pull_bytes_per_s
        at_once = max(1, min(n, shape.kv_tokens // max(ctx + answer, 1)))
        total += prefill + math.ceil(n / at_once) * answer * shape.step_s + (think if k < turns else 0.0)
    return total


# -- one wave --------------------------------------------------------------------------------------


def _ms(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 1)


def _pcts(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": _ms(percentile(values, 50)),
        "p99": _ms(percentile(values, 99)),
        "max": _ms(max(values)) if values else None,
    }


def deadline_miss(r: RequestRecord) -> bool:
    """The client gave up on the request (its deadline), as opposed to an answer that failed."""
    return r.error is not None and "Timeout" in r.error.split(":", 1)[0]


def goodput(records: list[RequestRecord], spec: WorkloadSpec, slo: Slo, wall_s: float) -> dict[str, Any]:
    """The wave's goodput (``vllm bench serve --goodput``'s count for a closed loop): turns that met both
    SLOs per second of the wave's wall time; attainment over the turns sent; TPOT percentiles."""
    st = point_stats(records, rate=0.0, conversations=spec.conversations, slo=slo)
    good = sum(1 for r in records if meets(r, slo))
    return {
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "good_turns": good,
        "goodput_per_s": round(good / wall_s, 3) if wall_s > 0 else None,
        "attainment": None if math.isnan(st.attainment) else round(st.attainment, 4),
        "throughput_per_s": round(sum(1 for r in records if r.ok) / wall_s, 3) if wall_s > 0 else None,
        "tpot_ms": {"p50": _ms(st.tpot_p50), "p99": _ms(st.tpot_p99)},
    }


def wave_summary(
    records: list[RequestRecord], convs: list[Conversation], spec: WorkloadSpec, *, cut: bool, offset_s: float
) -> tuple[dict[str, Any], list[list[Any]]]:
    """The wave's numbers, and a compact row per request (start is from the mode's start)."""
    ok = [r for r in records if r.ok]
    hung = [r for r in records if deadline_miss(r)]
    failed = [r for r in records if not r.ok and not deadline_miss(r)]
    sent = sum(1 for c in convs for m in c.messages if m["role"] == "user")
    ttft = {
        "turn 1": [r.ttft_ms for r in ok if r.turn == 1 and r.ttft_ms is not None],
        "later turns": [r.ttft_ms for r in ok if r.turn > 1 and r.ttft_ms is not None],
    }
    by_turn = {
        str(t): _pcts([r.ttft_ms for r in ok if r.turn == t and r.ttft_ms is not None])
        for t in sorted({r.turn for r in records})
    }
    decisions = Counter(
        f"{'turn 1' if r.turn == 1 else 'later turns'}: {r.decision.get('outcome')}/"
        f"{r.decision.get('action')}/{r.decision.get('reason')}"
        for r in records
        if r.decision
    )
    errors = Counter((r.error or "")[:120] for r in records if not r.ok)
    summary = {
        "conversations": spec.conversations,
        "requests_expected": spec.conversations * spec.turns,
        "sent": sent,
        "answered": len(records),
        "ok": len(ok),
        "hung": len(hung),
        "failed": len(failed),
        "in_flight_at_cut": sent - len(records),
        "not_sent": spec.conversations * spec.turns - sent,
        "cut": cut,
        "ttft_ms": {k: _pcts(v) for k, v in ttft.items()},
        "ttft_ms_by_turn": by_turn,
        "itl_ms": _pcts([x for r in ok for x in r.itl_ms]),
        "latency_ms": _pcts([r.latency_ms for r in ok if r.latency_ms is not None]),
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "decisions": dict(decisions.most_common()),
        "errors": dict(errors.most_common(8)),
    }
    rows = [
        [
            round(r.start_s + offset_s, 2),
            r.turn,
            None if r.ttft_ms is None else round(r.ttft_ms, 1),
            None if r.latency_ms is None else round(r.latency_ms, 1),
            0 if r.ok else 1 if deadline_miss(r) else 2,
        ]
        for r in records
    ]
    return summary, rows


def run_wave(
    spec: WorkloadSpec, target: Target, vocab: list[str], allowed: list[int], end: float
) -> tuple[list[RequestRecord], list[Conversation], bool]:
    """The wave, cut at ``end`` (perf_counter) if still running: its finished requests, its
    conversations (what each sent), and whether it was cut."""
    convs: list[Conversation] = []

    def conversation(index: int, s: WorkloadSpec) -> Conversation:
        c = Conversation(index, s, vocab=vocab, extra_body={"allowed_token_ids": allowed})
        convs.append(c)
        return c

    records: list[RequestRecord] = []

    async def go() -> bool:
        try:
            await asyncio.wait_for(
                run_load(spec, target, show_progress=False, conversation=conversation, records=records),
                timeout=max(1.0, end - time.perf_counter()),
            )
        except TimeoutError:
            return True
        return False

    cut = asyncio.run(go())
    records.sort(key=lambda r: (r.start_s, r.conversation))
    return records, convs, cut


# -- the run ----------------------------------------------------------------------------------------


def write(res: dict[str, Any], label: str) -> Path:
    path = devlib.out_dir() / f"load_{label}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, separators=(",", ":"), default=str))
    tmp.replace(path)
    return path


def requests_key(mode: str, rnd: int) -> str:
    """The key of a mode's run in the output (its request rows, ``requests_key``): the name, ``@round`` after
    the first round."""
    return mode if rnd == 1 else f"{mode}@{rnd}"


def seed_for(label: str, mode: str, wave: int) -> int:
    return zlib.crc32(f"{label}:{mode}:{wave}".encode()) & 0x7FFFFFFF


def settle(d: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Wait (bounded) until D runs and queues nothing; D's series as last read."""
    deadline = time.monotonic() + timeout_s
    last = sums(d, D_SERIES)
    while time.monotonic() < deadline and (last.get("d_run", 0) or last.get("d_wait", 0)):
        time.sleep(0.5)
        last = sums(d, D_SERIES)
    return last


def restart_d_if_full(spec: devlib.EngineSpec, a: argparse.Namespace, end: float) -> dict[str, Any] | None:
    """Between modes D should be idle and nearly empty (the gateway's shutdown released its pins, and
    D's prefix cache counts as free): a D still fuller than ``--restart-d-above`` holds pins nobody
    releases (a leak, or pd-direct's), which would spoil every later mode; it is restarted where
    the time budget allows (recorded either way)."""
    at = settle(spec.url, timeout_s=10.0)
    if at.get("d_kv", 0.0) <= a.restart_d_above:
        return None
    note: dict[str, Any] = {"d_kv": at.get("d_kv"), "restarted": False}
    devlib.log(f"D's KV usage is {at.get('d_kv')} between modes")
    if end - time.perf_counter() > 150:
        devlib.stop(spec.name)
        note["start_s"] = devlib.start_engine(spec, time_scale=a.sim_time_scale).get("start_s")
        note["restarted"] = True
    return note


def chunked_d_flags(chunk: int) -> list[str]:
    """D's flags for ``--d-chunk``: at most ``chunk`` tokens a step (prefill and decode together), and of one
    prefill, so that a prefill on D lengthens its streams' steps by a chunk's compute at most."""
    if chunk <= 0:
        return []
    return ["--max-num-batched-tokens", str(chunk), "--long-prefill-token-threshold", str(chunk)]


def start_engines(a: argparse.Namespace, res: dict[str, Any]) -> list[devlib.EngineSpec]:
    """P and D (reused where already running with the same command line). With ``--kv-lease-s`` both get
    ``kv_lease_duration``; should an engine not start with it, both are started without it."""
    p_flags = [] if a.p_cache == "on" else ["--no-enable-prefix-caching"]
    env = dict(kv.split("=", 1) for kv in a.ucx)
    d_sim = ["--num-gpu-blocks", str(a.sim_d_blocks)] if a.sim_d_blocks else []
    d_flags = chunked_d_flags(a.d_chunk)
    extras: list[dict[str, object]] = [{"kv_lease_duration": a.kv_lease_s}] if a.kv_lease_s else []
    extras.append({})
    for kv_extra in extras:
        specs = engines.pair(
            a.size, p_flags=p_flags, d_flags=d_flags, env=env, kv_extra=kv_extra, d_sim_extra=d_sim, gpus=a.gpus
        )
        try:
            res["engine_start_s"] = {
                s.name: devlib.start_engine(s, time_scale=a.sim_time_scale).get("start_s") for s in specs
            }
        except RuntimeError as exc:
            res.setdefault("engine_failures", []).append({"kv_extra": kv_extra, "error": str(exc)[-2000:]})
            devlib.log(f"engines did not start with {kv_extra}: {str(exc)[-300:]}")
            for s in specs:
                devlib.stop(s.name)
            continue
        res["kv_extra"] = kv_extra
        res["engines"] = {s.name: devlib.vllm_command(s)[0] for s in specs}
        return specs
    raise RuntimeError("the engines did not start")


def run_mode(
    a: argparse.Namespace,
    mode: Mode,
    p: str,
    d: str,
    vocab: list[str],
    allowed: list[int],
    end: float,
    res: dict[str, Any],
    rows: list[list[Any]],
    rnd: int = 1,
) -> dict[str, Any]:
    """One mode's waves (``rnd``: which round of ``--rounds``)."""
    t0 = time.perf_counter()
    key = requests_key(mode.name, rnd)
    out: dict[str, Any] = {"mode": mode.name, "round": rnd, "requests_key": key, "at_start": settle(d), "waves": []}
    gw_name = f"gw-{mode.name}"
    params = dict(mode.params)
    if a.d_chunk > 0 and mode.policy == "adaptive":
        params.setdefault("decode_chunk_tokens", a.d_chunk)  # the policy prices D's prefill a chunk a step
    settings: dict[str, Any] = {
        "health_interval_s": 1.0,
        "scrape_interval_s": 1.0,
        "policy": {"name": mode.policy, "params": params},
        **dict(mode.settings),
    }
    if not mode.session and not mode.history:
        # plain P/D: no conversation at all (the gateway would otherwise find each one from its history)
        settings["conversation_from_history"] = False
    log0 = devlib.log_size(gw_name)
    with contextlib.ExitStack() as stack:
        gw: str | None = None
        if mode.gateway:
            gw = stack.enter_context(
                devlib.gateway(gw_name, GATEWAY_PORT, [p], [d], policy=mode.policy, settings=settings)
            )
            out["gateway_settings"] = settings
            out["gateway_gpus"] = gpus_told(gw)
            devlib.log(f"{a.label} {key}: the gateway's view of the GPUs: {json.dumps(out['gateway_gpus'])}")
            target = Target(url=gw)
        elif mode.name == "pd-direct":
            target = Target(prefill=p, decode=d)
        else:
            target = Target(url=d)
        max_samples = int(max(end - t0, 1.0) / a.sample_s) + 10
        sampler = stack.enter_context(Sampler(d, p, gw, t0, a.sample_s, max_samples))
        counters = [gateway_counters(gw)] if gw else []
        plan = [n for n in a.levels for _ in range(a.waves)]
        for wave, n in enumerate(plan, start=1):
            now = time.perf_counter()
            if now >= end - 5:
                out["waves"].append({"wave": wave, "skipped": "time budget"})
                break
            spec = WorkloadSpec(
                conversations=n,
                turns=a.turns,
                system_tokens=a.system_tokens,
                user_tokens=a.user_tokens,
                answer_tokens=a.answer_tokens,
                think_time_s=a.think_time_s,
                rate=0,
                concurrency=n,
                session_header=mode.session,
                model=devlib.MODEL_NAME,
                seed=seed_for(a.label, key, wave),  # new prompts each round: nothing cached from an earlier one
                # the same think times for every mode of a round: their waves differ in what they serve only
                think_seed=seed_for(a.label, f"round {rnd}", wave),
                duration_s=max(1.0, end - now),
                request_timeout_s=a.request_timeout_s,
            )
            before = {"p": devlib.metrics(p), "d": devlib.metrics(d)}
            w0 = time.perf_counter()
            records, convs, cut = run_wave(spec, target, vocab, allowed, end)
            w1 = time.perf_counter()
            summary, wave_rows = wave_summary(records, convs, spec, cut=cut, offset_s=w0 - t0)
            summary["goodput"] = goodput(records, spec, Slo(a.slo_ttft_ms, a.slo_tpot_ms), w1 - w0)
            after = {"p": devlib.metrics(p), "d": devlib.metrics(d)}
            summary.update(
                wave=wave,
                seed=spec.seed,
                start_s=round(w0 - t0, 2),
                end_s=round(w1 - t0, 2),
                wall_s=round(w1 - w0, 2),
                nixl_p_reads=devlib.nixl_delta(before["p"], after["p"]),
                nixl_d_reads=devlib.nixl_delta(before["d"], after["d"]),
            )
            if gw:
                counters.append(gateway_counters(gw))
                summary["gateway_counters"] = counter_delta(counters[-2], counters[-1])
            out["waves"].append(summary)
            for r in wave_rows:
                r.insert(0, wave)
            rows.extend(wave_rows[: max(0, MAX_REQUEST_ROWS - len(rows))])
            t = summary["ttft_ms"]
            devlib.log(
                f"{a.label} {key} wave {wave} ({n} conv): {summary['answered']}/{summary['requests_expected']} "
                f"answered, {summary['hung']} hung, {summary['failed']} failed, {summary['not_sent']} not "
                f"sent{' (CUT)' if cut else ''}; TTFT p50/p99 ms turn 1 {t['turn 1']['p50']}/"
                f"{t['turn 1']['p99']}, later {t['later turns']['p50']}/{t['later turns']['p99']}; ITL "
                f"p50/p99 {summary['itl_ms']['p50']}/{summary['itl_ms']['p99']}; goodput "
                f"{summary['goodput']['goodput_per_s']}/s ({summary['goodput']['attainment']}); {w1 - w0:.1f} s"
            )
            res["modes"][-1] = {**out, "timeline": timeline(list(sampler.samples))}
            write(res, a.label)
        # after the waves, before the gateway stops: what stays pinned at rest
        time.sleep(min(2.0, max(0.0, end - time.perf_counter())))
        if gw:
            out["gateway_at_rest"] = sums(gw, GW_SERIES)
            out["gateway_counters_total"] = counter_delta(counters[0], gateway_counters(gw))
    out["timeline"] = timeline(list(sampler.samples))
    if mode.gateway:
        out["gateway_log"] = gateway_log_summary(gw_name, log0)
    out["after_stop"] = settle(d, timeout_s=5.0)  # the gateway's shutdown released its pins
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="L1")
    ap.add_argument("--p-cache", choices=["on", "off"], default="on")
    ap.add_argument("--size", default="8b", choices=["8b", "1b"])
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, in order, of {', '.join(MODES)}")
    ap.add_argument(
        "--conversations", default="32", help="conversations at once; a comma-separated list sweeps them in turn"
    )
    ap.add_argument("--waves", type=int, default=2, help="waves per conversation count")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the list of modes this many times over, interleaved (A B C A B C): the spread of one mode's "
        "rounds is this GPU's noise, and each round's modes ran within a minute or two of each other",
    )
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT SLO (vLLM's ttft:2000)")
    ap.add_argument("--slo-tpot-ms", type=float, default=30.0, help="goodput's TPOT SLO (vLLM's tpot:30)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=8192)
    ap.add_argument("--user-tokens", type=int, default=200)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--think-time-s", type=float, default=0.5, help="mean of an exponential")
    ap.add_argument("--request-timeout-s", type=float, default=120.0, help="client deadline per request")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument(
        "--ucx",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for both engines, e.g. UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y",
    )
    ap.add_argument(
        "--kv-lease-s",
        type=int,
        default=180,
        help="kv_lease_duration on both engines (docs/decode-memory.md); 0 leaves vLLM's 30 s",
    )
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=480.0,
        help="nothing runs past this many seconds from the start (engine start included)",
    )
    ap.add_argument(
        "--restart-d-above",
        type=float,
        default=0.5,
        help="restart D between modes if its KV usage is above this at rest (a leak)",
    )
    ap.add_argument(
        "--d-chunk",
        type=int,
        default=0,
        help="start D taking at most this many tokens a step (--max-num-batched-tokens and "
        "--long-prefill-token-threshold), and tell adaptive policies so (decode_chunk_tokens); 0: vLLM's defaults",
    )
    ap.add_argument(
        "--gpus",
        type=lambda v: tuple(v.split(",", 1)),
        default=None,
        metavar="P,D",
        help="P's and D's CUDA_VISIBLE_DEVICES (e.g. 0,1: P and D apart, which shared_gpu auto then finds); "
        "default: both on the first GPU",
    )
    ap.add_argument("--sim-d-blocks", type=int, default=0, help="simulator only: D's --num-gpu-blocks")
    ap.add_argument("--sim-time-scale", type=float, default=1.0, help="simulator only")
    a = ap.parse_args(argv)
    a.levels = sorted(int(x) for x in str(a.conversations).split(",") if x)
    if not a.levels or min(a.levels) < 1 or a.waves < 1 or a.rounds < 1:
        ap.error("--conversations needs counts >= 1, --waves and --rounds >= 1")
    t_start = time.perf_counter()
    end = t_start + a.time_budget_s
    listed = [MODES[m] for m in a.modes.split(",") if m]
    runs = [(r + 1, mode) for r in range(a.rounds) for mode in listed]
    res: dict[str, Any] = {
        "backend": devlib.backend(),
        "label": a.label,
        "args": vars(a),
        "modes": [],
        "skipped": [],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "think_time": "exponential",
    }  # turnkv bench's: mean --think-time-s
    try:
        specs = start_engines(a, res)
        p, d = specs[0].url, specs[1].url
        pairs = devlib.words_for(p, 3000)
        vocab = [w for w, _ in pairs]
        allowed = [i for _, i in pairs[:400]]
        res["vocabulary"] = {"words": len(vocab), "allowed_token_ids": len(allowed)}
        res["request_columns"] = [
            "wave",
            "start_s",
            "turn",
            "ttft_ms",
            "latency_ms",
            "status (0 ok, 1 deadline, 2 failed)",
        ]
        res["requests"] = {}
        ratio: list[float] = []  # measured / estimated, per finished wave
        for rnd, mode in runs:
            key = requests_key(mode.name, rnd)
            est = [
                estimate_wave_s(
                    n,
                    a.turns,
                    a.system_tokens,
                    a.user_tokens,
                    a.answer_tokens,
                    a.think_time_s,
                    mode=mode.name,
                    p_cache=a.p_cache == "on",
                )
                for n in a.levels
                for _ in range(a.waves)
            ]
            scale = (sum(ratio) / len(ratio)) if ratio else 1.0
            need = sum(est) * scale + (15.0 if mode.gateway else 5.0)
            left = end - time.perf_counter()
            if need > left:
                skip = {"mode": mode.name, "round": rnd, "needed_s": round(need, 1), "left_s": round(left, 1)}
                res["skipped"].append(skip)
                devlib.log(f"{a.label} {key}: skipped, needs ~{need:.0f} s, {left:.0f} s left")
                continue
            restarted = restart_d_if_full(specs[1], a, end)
            res["modes"].append({"mode": mode.name, "round": rnd, "requests_key": key})
            rows = res["requests"][key] = []
            m = run_mode(a, mode, p, d, vocab, allowed, end, res, rows, rnd)
            m.update(estimate_wave_s=[round(e, 1) for e in est], d_restarted_before=restarted)
            res["modes"][-1] = m
            ratio += [
                w["wall_s"] / e
                for w, e in zip(m["waves"], est, strict=False)
                if "wall_s" in w and not w.get("cut") and e > 0
            ]
            write(res, a.label)
    except Exception as exc:  # the file is written whatever happens
        res["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        devlib.log(f"{a.label}: {res['error'][-500:]}")
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    path = write(res, a.label)
    print(json.dumps(brief(res), indent=1))
    devlib.log(f"wrote {path} ({os.path.getsize(path) / 1e3:.0f} kB)")
    return 0 if "error" not in res else 1


def brief(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "label": res["label"],
        "skipped": res["skipped"],
        "seconds": res.get("seconds"),
        "error": res.get("error"),
    }
    for m in res["modes"]:
        for w in m.get("waves", []):
            if "ttft_ms" in w:
                t = w["ttft_ms"]
                out[f"{m['mode']} wave {w['wave']} ({w.get('conversations')} conv)"] = {
                    **{k: w[k] for k in ("answered", "hung", "failed", "not_sent", "cut")},
                    "ttft_p99_turn1": t["turn 1"]["p99"],
                    "ttft_p99_later": t["later turns"]["p99"],
                    "itl_p99": w["itl_ms"]["p99"],
                    "goodput": w.get("goodput", {}).get("goodput_per_s"),
                }
    return out


if __name__ == "__main__":
    sys.exit(main())
