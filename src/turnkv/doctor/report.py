"""The doctor's report: a short text for an operator (a verdict per item, the fix under each problem, what
the probes cost the engines, what was measured) and the same as JSON for a file."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from turnkv.doctor.checks.fmt import gbps, ms, tokens
from turnkv.doctor.findings import Verdict, blocking
from turnkv.doctor.run import Report

_MARK = {
    Verdict.OK: "ok",
    Verdict.INFO: "info",
    Verdict.WARN: "WARN",
    Verdict.FAIL: "FAIL",
    Verdict.SKIPPED: "skip",
}


def text(r: Report) -> str:
    obs = r.observed
    lines = [
        "turnkv doctor: "
        + "; ".join(f"{e.role} {e.url}" for e in (*obs.engines, *([obs.render] if obs.render else []))),
        _load(r),
        "",
    ]
    width = max((len(f.item.value) for f in r.findings), default=10)
    for f in r.findings:
        lines.append(f"{_MARK[f.verdict]:<5} {f.item.value:<{width}}  {f.summary}")
        if f.fix and f.verdict in (Verdict.FAIL, Verdict.WARN):
            lines.append(f"{'':<5} {'':<{width}}  fix: {f.fix}")
    lines += ["", *_measured(r)]
    bad = blocking(r.findings)
    warn = sum(1 for f in r.findings if f.verdict is Verdict.WARN)
    lines.append(
        f"{len(bad)} blocking problem{'s' if len(bad) != 1 else ''}, {warn} warning{'s' if warn != 1 else ''} "
        f"({r.seconds:.0f} s): exit {r.exit_status}"
    )
    return "\n".join(lines)


def _load(r: Report) -> str:
    t = r.observed.transfer
    if t is None:
        return "load added: none (no transfer measured); a few metadata and render requests"
    ld = t.load
    left = f", {ld.left_pinned} left pinned until D's TTL" if ld.left_pinned else ", nothing left pinned"
    return (
        f"load added: {ld.prefill_requests} requests to P ({tokens(ld.prefilled_tokens)} tokens prefilled), "
        f"{ld.decode_requests} to D (one token each), {ld.moved_bytes / 1e9:.2f} GB of KV moved, "
        f"in {ld.seconds:.1f} s; "
        f"{ld.released} handles given back{left}"
    )


def _measured(r: Report) -> list[str]:
    f = r.figures
    if f is None:
        return []
    parts = []
    for name, fit in (("P -> D", f.push), ("D -> P", f.pull)):
        if fit is not None:
            parts.append(f"{name} {gbps(fit.bytes_per_s)} + {ms(fit.fixed_s)}")
    if f.compute is not None:
        c = f.compute
        parts.append(
            f"P {c.us_per_token:.1f} us/token + {c.attn_ns:.2f} ns/token/token of context, hop {c.hop_ms:.1f} ms"
        )
    if f.kv_bytes_per_token is not None:
        parts.append(f"{tokens(f.kv_bytes_per_token)} bytes/token")
    return [f"measured: {'; '.join(parts)}"] if parts else []


def as_json(r: Report) -> dict[str, Any]:
    obs = r.observed
    return {
        "format": 1,
        "started_at": r.started_at,
        "seconds": r.seconds,
        "exit_status": r.exit_status,
        "engines": [_plain(e) for e in (*obs.engines, *([obs.render] if obs.render else []))],
        "template": _plain(obs.template),
        "transfer": _plain(obs.transfer),
        "host": _plain(obs.host),
        "findings": [_plain(f) for f in r.findings],
        "figures": _plain(r.figures),
        "profile": r.profile.model_dump(),
    }


def _plain(v: Any) -> Any:
    """Dataclasses, enums, sets and tuples as JSON values."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, dict):
        return {_key(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted(_plain(x) for x in v)
    if hasattr(v, "model_dump"):
        return v.model_dump()
    return v


def _key(k: Any) -> str:
    return "-".join(str(x) for x in k) if isinstance(k, tuple) else str(k)
