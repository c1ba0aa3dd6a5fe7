"""One doctor run: describe every engine, audit the template, probe the transfer between the first P and D
that serve one model, judge, and build the profile the gateway loads.

Engine-neutral: the engine family comes in as ``base.Engine`` (a turn's calls) and
``diagnostics.EngineDiagnostics`` (what the doctor asks beside them), opened from the gateway's settings.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from turnkv.config import Settings
from turnkv.doctor import host as hostlib
from turnkv.doctor.audit import audit
from turnkv.doctor.checks import Context, Observed
from turnkv.doctor.checks import engines as engine_checks
from turnkv.doctor.checks import memory as memory_checks
from turnkv.doctor.checks import template as template_checks
from turnkv.doctor.checks import transfer as transfer_checks
from turnkv.doctor.facts import EngineFacts, HostFacts, TemplateFacts, TransferFacts
from turnkv.doctor.findings import Finding, exit_status
from turnkv.doctor.probe import Plan, Probe
from turnkv.engine.base import Engine
from turnkv.engine.diagnostics import EngineDiagnostics, LogFacts
from turnkv.gateway.app import cost_priors
from turnkv.profile import Profile
from turnkv.reuse.policies import build_policy

LOG_TAIL_BYTES = 4 * 1024 * 1024  # of an engine log given with --log: its end is what matters


@dataclass(frozen=True)
class Options:
    sizes: tuple[int, ...] = (2048, 8192, 32768)
    budget_s: float = 90.0  # the transfer probe, all sizes
    call_timeout_s: float = 120.0
    turn_tokens: int = 150
    history_tokens: int = 16384
    logs: Mapping[str, str] = field(default_factory=dict)  # role or engine URL -> log file
    measure: bool = True


@dataclass(frozen=True)
class Report:
    started_at: str
    seconds: float
    observed: Observed
    findings: tuple[Finding, ...]
    figures: transfer_checks.Figures | None
    profile: Profile

    @property
    def exit_status(self) -> int:
        return exit_status(self.findings)


async def diagnose(settings: Settings, options: Options, engine: Engine, probes: EngineDiagnostics) -> Report:
    started, t0 = datetime.now(UTC).isoformat(timespec="seconds"), time.monotonic()
    facts, host = await _engines(settings, options, probes)
    prefill = tuple(f for f in facts if f.role == "prefill")
    decode = tuple(f for f in facts if f.role == "decode")
    render = next((f for f in facts if f.role == "render"), None)
    model = _model(settings, prefill, decode)
    template = await _template(engine, settings, prefill, decode, render, model)
    pair = _pair(prefill, decode)
    transfer = None
    if pair is not None and options.measure:
        transfer = await Probe(engine, probes, _plan(settings, options, pair, model)).run()
    obs = Observed(prefill, decode, render, template, transfer, host)
    ctx = Context(
        settings=settings,
        advice=probes.advice,
        checks_tokens=build_policy(settings.policy.name, settings.policy.params).checks_tokens,
        turn_tokens=options.turn_tokens,
        history_tokens=options.history_tokens,
    )
    figures = None
    if transfer is not None and pair is not None:
        longest = min((e.max_model_len for e in pair if e.max_model_len), default=max(options.sizes) * 4)
        figures = transfer_checks.figures(transfer, cost_priors(settings), ctx, longest)
    findings = (
        engine_checks.check(obs, ctx)
        + template_checks.check(obs, ctx)
        + (transfer_checks.check(obs, ctx, figures) if options.measure else [])
        + memory_checks.check(obs, ctx)
    )
    profile = _profile(started, settings, transfer, figures, pair, model)
    return Report(started, round(time.monotonic() - t0, 2), obs, tuple(findings), figures, profile)


async def _engines(
    settings: Settings, options: Options, probes: EngineDiagnostics
) -> tuple[list[EngineFacts], HostFacts]:
    """Every engine the settings name, as it describes itself, with its log (``--log``) and whether it runs
    on this machine; and this machine's GPU topology where any does."""
    s = settings
    extra = [s.render] if s.render and s.render not in (*s.prefill, *s.decode) else []
    urls = [*s.prefill, *s.decode, *extra]
    roles = ["prefill"] * len(s.prefill) + ["decode"] * len(s.decode) + ["render"] * len(extra)
    descriptions = await asyncio.gather(*(probes.describe(u) for u in urls))
    local = await asyncio.gather(*(asyncio.to_thread(hostlib.is_local, u) for u in urls))
    host = await asyncio.to_thread(hostlib.host_facts) if any(local) else HostFacts(detail="no engine on this machine")
    facts = [
        EngineFacts(u, r, d, _log(probes, options.logs, u, r), loc)
        for u, r, d, loc in zip(urls, roles, descriptions, local, strict=True)
    ]
    return facts, host


def _log(probes: EngineDiagnostics, logs: Mapping[str, str], url: str, role: str) -> LogFacts | None:
    path = logs.get(url) or logs.get(role)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return probes.read_log(text)


def _model(settings: Settings, prefill: tuple[EngineFacts, ...], decode: tuple[EngineFacts, ...]) -> str | None:
    if settings.models:
        return settings.models[0]
    for p in prefill:
        for d in decode:
            common = sorted(p.models & d.models)
            if common:
                return common[0]
    return next((sorted(e.models)[0] for e in (*prefill, *decode) if e.models), None)


def _pair(prefill: tuple[EngineFacts, ...], decode: tuple[EngineFacts, ...]) -> tuple[EngineFacts, EngineFacts] | None:
    """The first P and D that are up and serve one model (any model where neither lists one)."""
    for p in prefill:
        for d in decode:
            if p.description and d.description and (p.models & d.models or not (p.models or d.models)):
                return p, d
    return None


def _plan(settings: Settings, options: Options, pair: tuple[EngineFacts, EngineFacts], model: str | None) -> Plan:
    p, d = pair
    assert p.description is not None and d.description is not None
    lens = [n for n in (p.max_model_len, d.max_model_len) if n]
    caps = [c for c in (p.description.capacity_tokens, d.description.capacity_tokens) if c]
    tokenizers = [e.url for e in (p, d) if e.description and e.description.tokenizer is not False]
    if settings.render:
        tokenizers.append(settings.render)
    return Plan(
        prefill=p.url,
        decode=d.url,
        model=model,
        block_size=p.description.block_size or settings.block_size,
        sizes=options.sizes,
        budget_s=options.budget_s,
        call_timeout_s=options.call_timeout_s,
        max_tokens=min(lens) if lens else None,
        capacity=min(caps) if caps else None,
        run_id=uuid.uuid4().hex[:8],
        tokenizers=tuple(tokenizers),
    )


async def _template(
    engine: Engine,
    settings: Settings,
    prefill: tuple[EngineFacts, ...],
    decode: tuple[EngineFacts, ...],
    render: EngineFacts | None,
    model: str | None,
) -> TemplateFacts | None:
    target = render or next((e for e in (*prefill, *decode) if e.url == settings.render), None)
    configured = target is not None
    target = target or (prefill[0] if prefill else None)
    if target is None:
        return None
    return await audit(engine, target, configured, decode[0] if decode else None, model)


def _profile(
    started: str,
    settings: Settings,
    t: TransferFacts | None,
    f: transfer_checks.Figures | None,
    pair: tuple[EngineFacts, EngineFacts] | None,
    model: str | None,
) -> Profile:
    """What was measured, for the gateway; without a measurement, a profile of no figures (the gateway
    then keeps its settings' priors), so that a deployment that loads it always finds one."""
    p = pair[0].description if pair else None
    threshold = p.transfer.recompute_threshold if p is not None and p.transfer is not None else None
    return Profile(
        measured_at=started,
        prefill=t.prefill if t else (pair[0].url if pair else ",".join(settings.prefill)),
        decode=t.decode if t else (pair[1].url if pair else ",".join(settings.decode)),
        engine_version=p.version if p else None,
        model=model,
        pull=f.pull.figures() if f and f.pull else None,
        push=f.push.figures() if f and f.push else None,
        compute=f.compute if f else None,
        kv_bytes_per_token=f.kv_bytes_per_token if f else None,
        block_size=t.block_size if t else None,
        recompute_threshold=threshold,
    )
