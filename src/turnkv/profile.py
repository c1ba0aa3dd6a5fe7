"""The profile ``turnkv doctor`` writes and ``turnkv serve`` loads: what the doctor measured of the link
and of P's compute, to be the cost model's priors instead of the defaults.

The gateway's estimator starts from its priors (``reuse.estimator``) and replaces them with what it
learns from turns as they come; until enough turns were seen, the priors decide whether a pull pays.
The defaults are one H200 host's (NIXL over TCP); a profile puts this deployment's own figures there
from the first turn. Settings: ``profile: FILE`` (``TURNKV_PROFILE``, ``turnkv serve --profile``); the
figures it holds replace ``costs:``'s, the rest of ``costs:`` stands; ``/ready`` shows which were used.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turnkv.reuse.cost import CostParams


class LinkFigures(BaseModel):
    """A KV transfer path as measured: a fixed cost per transfer plus bytes over bandwidth."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    fixed_ms: float = Field(ge=0)
    gbps: float = Field(gt=0, description="bandwidth in GB/s (1e9 bytes per second)")
    samples: int = Field(ge=1, description="transfers measured")


class ComputeFigures(BaseModel):
    """P's prefill as the gateway times it (the whole call): hop + per token + attention per token of context."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    hop_ms: float = Field(ge=0)
    us_per_token: float = Field(gt=0)
    attn_ns: float = Field(ge=0)
    samples: int = Field(ge=1)


class Profile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal[1] = 1
    measured_at: str = Field(description="when, UTC, ISO 8601")
    prefill: str = Field(description="the prefill engine measured")
    decode: str = Field(description="the decode engine measured")
    engine_version: str | None = None
    model: str | None = None
    pull: LinkFigures | None = Field(None, description="D -> P: P reads D's blocks")
    push: LinkFigures | None = Field(None, description="P -> D: D reads P's blocks")
    compute: ComputeFigures | None = None
    kv_bytes_per_token: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    recompute_threshold: int | None = Field(None, ge=0)

    def priors(self, base: CostParams) -> CostParams:
        """``base`` with what this profile measured in place of its figures."""
        out = base
        if self.pull is not None:
            out = replace(out, link_fixed_s=self.pull.fixed_ms / 1e3, link_bytes_per_s=self.pull.gbps * 1e9)
        if self.push is not None:
            out = replace(out, push_fixed_s=self.push.fixed_ms / 1e3, push_bytes_per_s=self.push.gbps * 1e9)
        elif self.pull is not None:
            out = replace(out, push_fixed_s=None, push_bytes_per_s=None)  # P -> D as D -> P
        if self.compute is not None:
            c = self.compute
            out = replace(
                out, hop_s=c.hop_ms / 1e3, prefill_per_token_s=c.us_per_token / 1e6, prefill_attn_s=c.attn_ns / 1e9
            )
        if self.kv_bytes_per_token is not None:
            out = replace(out, kv_bytes_per_token=self.kv_bytes_per_token)
        if self.recompute_threshold is not None:
            out = replace(out, recompute_threshold=self.recompute_threshold)
        return out

    def summary(self) -> dict[str, Any]:
        """What ``/ready`` shows of it."""
        return {
            "measured_at": self.measured_at,
            "prefill": self.prefill,
            "decode": self.decode,
            "pull": None if self.pull is None else self.pull.model_dump(),
            "push": None if self.push is None else self.push.model_dump(),
            "compute": None if self.compute is None else self.compute.model_dump(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


def load_profile(path: str | Path) -> Profile:
    """The profile in ``path``; ``ValueError`` saying why when it cannot be used."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"profile {p}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"profile {p} is not JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]  # a doctor report (--json) holds its profile
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"profile {p} is not a turnkv doctor profile: {exc}") from None


def write_profile(path: str | Path, profile: Profile) -> None:
    Path(path).write_text(profile.model_dump_json(indent=1) + "\n")


def priors_view(params: CostParams, profile: Profile | None, path: str | None) -> dict[str, Any]:
    """The cost model's priors as ``/ready`` shows them, and where they came from."""
    fixed, bw = params.link()
    pfixed, pbw = params.link(push=True)
    return {
        "source": "profile" if profile is not None else "settings",
        **({"profile": {"file": path, **profile.summary()}} if profile is not None else {}),
        "pull": {"fixed_ms": round(fixed * 1e3, 3), "gbps": round(bw / 1e9, 3)},
        "push": {"fixed_ms": round(pfixed * 1e3, 3), "gbps": round(pbw / 1e9, 3)},
        "prefill_us_per_token": round(params.prefill_per_token_s * 1e6, 3),
        "prefill_attn_ns": round(params.prefill_attn_s * 1e9, 4),
        "hop_ms": round(params.hop_s * 1e3, 3),
        "kv_bytes_per_token": params.kv_bytes_per_token,
    }
