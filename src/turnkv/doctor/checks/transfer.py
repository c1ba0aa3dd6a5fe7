"""The transfer, both ways: each direction's rate and fixed cost against what the GPUs' path should do,
the transports the engines' logs show, the bytes per token of KV, and the history length above which a
pull beats recomputing on this P (decided by the gateway's own cost model with the measured figures)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from turnkv.doctor import link
from turnkv.doctor.checks import Context, Observed
from turnkv.doctor.checks.fmt import gbps, ms, tokens
from turnkv.doctor.facts import PullOutcome, TransferFacts
from turnkv.doctor.findings import Finding, Item, Verdict
from turnkv.engine.diagnostics import Advice
from turnkv.profile import ComputeFigures
from turnkv.reuse.cost import Action, CostParams

KV_BYTES_OFF = 0.1  # the gateway's kv_bytes_per_token is off by more than this share of what was measured


@dataclass(frozen=True)
class Figures:
    pull: link.LinkFit | None  # D -> P
    push: link.LinkFit | None  # P -> D
    compute: ComputeFigures | None
    kv_bytes_per_token: int | None
    costs: CostParams  # the gateway's priors with the above in place
    break_even: int | None  # tokens of history; None: a pull never pays (or was not measured)
    longest: int  # the longest prompt the break-even was sought up to


def figures(t: TransferFacts, prior: CostParams, ctx: Context, longest: int) -> Figures:
    pushes = [r.push for r in t.runs if r.push is not None]
    pulls = [r.pull for r in t.runs if r.pull is not None]
    bpt = link.kv_bytes_per_token([*pushes, *pulls], t.block_size)
    base = prior if bpt is None else replace(prior, kv_bytes_per_token=bpt)
    pull, push = link.fit_link(pulls), link.fit_link(pushes)
    compute = link.fit_compute(t.runs, base)
    costs = link.costs(base, pull, push, compute)
    be = link.break_even(costs, ctx.turn_tokens, longest, t.block_size) if pull is not None else None
    return Figures(pull, push, compute, bpt, costs, be, longest)


def check(obs: Observed, ctx: Context, f: Figures | None) -> list[Finding]:
    t = obs.transfer
    if t is None or f is None:
        return [Finding(Item.LINK_P_TO_D, Verdict.SKIPPED, "the transfer was not measured (no reachable P and D)")]
    p, d = obs.engine(t.prefill), obs.engine(t.decode)
    expect = link.expect(p, d, obs.host) if p is not None and d is not None else None
    out = [
        _direction(Item.LINK_P_TO_D, "P -> D (D reads P's KV after each prefill)", f.push, t, expect, ctx),
        _direction(Item.LINK_D_TO_P, "D -> P (P pulls D's KV)", f.pull, t, expect, ctx),
    ]
    out += _pull_failure(t, ctx)
    out += [
        Finding(
            Item.PROBE,
            Verdict.FAIL,
            f"the probe's P/D turn of {tokens(r.tokens)} tokens failed: {r.error}",
            fix="the engines answer a plain P/D turn as the gateway sends it; their logs say why they did not",
        )
        for r in t.runs
        if r.error
    ]
    out.append(_transports(obs, ctx))
    out.append(_pull_pays(t, f, ctx))
    out += _kv_bytes(f, ctx)
    for why in t.skipped:
        out.append(Finding(Item.PROBE, Verdict.INFO, why))
    return out


def _direction(
    item: Item, what: str, fit: link.LinkFit | None, t: TransferFacts, e: link.Expectation | None, ctx: Context
) -> Finding:
    if fit is None:
        return Finding(item, Verdict.SKIPPED, f"{what}: not measured")
    fixed = f", {ms(fit.fixed_s)} fixed per transfer" if fit.line else " (one size only: fixed cost not separated)"
    data = {
        "gbps": round(fit.bytes_per_s / 1e9, 4),
        "fixed_ms": round(fit.fixed_s * 1e3, 3),
        "samples": fit.samples,
        "line": fit.line,
        "path": e.path if e else None,
    }
    text = f"{what}: {gbps(fit.bytes_per_s)}{fixed}, {fit.samples} transfers"
    if e is not None:
        text += f"; path: {e.path} ({e.detail})"
    slow = link.far_below(fit.bytes_per_s, e) if e is not None else None
    if slow is None:
        return Finding(item, Verdict.OK, text, data=data)
    fix = ctx.advice(Advice.SLOW_LINK_SAME_HOST if e is not None and e.same_host else Advice.SLOW_LINK_HOSTS)
    if e is not None and e.same_host is None:
        fix = (
            f"on one host: {ctx.advice(Advice.SLOW_LINK_SAME_HOST)}; across hosts: {ctx.advice(Advice.SLOW_LINK_HOSTS)}"
        )
    return Finding(item, Verdict.WARN, f"{text}: {slow}", fix=fix, data=data)


def _pull_failure(t: TransferFacts, ctx: Context) -> list[Finding]:
    if t.pull is not PullOutcome.FAILED:
        return []
    return [
        Finding(
            Item.LINK_D_TO_P,
            Verdict.FAIL,
            f"P could not read D's KV: {t.pull_detail}",
            fix=ctx.advice(Advice.TRANSFER_FAILED),
            engine=t.prefill,
        )
    ]


def _transports(obs: Observed, ctx: Context) -> Finding:
    logs = [(e.role, e.log) for e in obs.engines if e.log is not None]
    if not logs:
        return Finding(
            Item.TRANSPORTS,
            Verdict.INFO,
            "the transports KV moves over were not read (no engine log given)",
            fix=ctx.advice(Advice.SHOW_TRANSPORTS),
        )
    parts = []
    emulated = False
    for role, lf in logs:
        if lf.transports:
            remote = ", ".join(sorted(lf.remote_access)) or "none (reads emulated over messages)"
            parts.append(f"{role}: {', '.join(sorted(lf.transports))}; remote reads over {remote}")
        emulated = emulated or lf.emulated
        parts += [f"{role}: {line}" for line in lf.transfer_lines[-1:]]
    if not parts:
        return Finding(
            Item.TRANSPORTS, Verdict.INFO, "the engines' logs name no transport", fix=ctx.advice(Advice.SHOW_TRANSPORTS)
        )
    return Finding(Item.TRANSPORTS, Verdict.WARN if emulated else Verdict.INFO, "; ".join(parts))


def _pull_pays(t: TransferFacts, f: Figures, ctx: Context) -> Finding:
    if f.pull is None:
        return Finding(Item.PULL_PAYS, Verdict.SKIPPED, "whether a pull pays was not measured (no pull was made)")
    turn = ctx.turn_tokens
    data: dict[str, object] = {"break_even_tokens": f.break_even, "turn_tokens": turn, "longest": f.longest}
    seen = _seen(t, f)
    if f.break_even is None:
        return Finding(
            Item.PULL_PAYS,
            Verdict.WARN,
            f"on this link a pull never beats recomputing on this P, up to {tokens(f.longest)} tokens of "
            f"prompt{seen}: bidirectional transfer saves nothing here; turnkv recomputes (or runs the turn on D) "
            "and keeps no pins for pulls",
            fix="make the link faster (the D -> P finding says how)",
            data=data,
        )
    h = max(f.break_even * 4, 8192)
    est = link.turn_estimate(f.costs, h, turn, t.block_size)
    at = f"at {tokens(h)}: pull {ms(est[Action.PULL])} vs recompute {ms(est[Action.RECOMPUTE])}"
    return Finding(
        Item.PULL_PAYS,
        Verdict.OK,
        f"a pull beats recomputing on this P above {tokens(f.break_even)} tokens of history "
        f"(turns of {turn} new tokens; {at}){seen}",
        data=data,
    )


def _seen(t: TransferFacts, f: Figures) -> str:
    """What the probes themselves showed: P's call with a pull against its cold prefill, size by size."""
    pairs = [
        f"{tokens(r.tokens)}: {ms(r.pull_call_s)} vs {ms(r.prefill_s)}"
        for r in t.runs
        if r.pull_call_s is not None and r.prefill_s is not None
    ]
    return f"; measured, P's call with the pull vs its cold prefill: {', '.join(pairs)}" if pairs else ""


def _kv_bytes(f: Figures, ctx: Context) -> list[Finding]:
    if f.kv_bytes_per_token is None:
        return []
    mine = ctx.settings.kv_bytes_per_token
    text = f"{tokens(f.kv_bytes_per_token)} bytes of KV per token (measured)"
    if abs(mine - f.kv_bytes_per_token) > KV_BYTES_OFF * f.kv_bytes_per_token:
        return [
            Finding(
                Item.KV_BYTES,
                Verdict.WARN,
                f"{text}; the gateway's kv_bytes_per_token is {tokens(mine)}",
                fix=f"set kv_bytes_per_token: {f.kv_bytes_per_token}, or load the doctor's profile (profile: FILE)",
                data={"measured": f.kv_bytes_per_token, "setting": mine},
            )
        ]
    return [Finding(Item.KV_BYTES, Verdict.OK, text, data={"measured": f.kv_bytes_per_token, "setting": mine})]
