"""The routing section of the settings: a profile names its plugins by type, with weights and parameters
(``config.Settings.routing_profiles``; ``router.build_profile`` builds it, refusing a bad one at start)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RoutingPlugin(BaseModel):
    """One routing plugin in a profile: its registered type, its weight (scorers) and its parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: str = Field(
        description="the plugin's name (turnkv.routing.plugins: filters not-tried, not-avoided, "
        "routable; scorers load, affinity, pin-headroom, ttft; picker max-score)"
    )
    weight: float = Field(1.0, ge=0, description="scorers: how much its score counts")
    params: dict[str, Any] = Field(default_factory=dict, description="the plugin's own parameters")


def _default_filters() -> list[RoutingPlugin]:
    return [RoutingPlugin(type="not-tried"), RoutingPlugin(type="not-avoided"), RoutingPlugin(type="routable")]


class RoutingProfile(BaseModel):
    """How a request's engine is chosen: filters, then weighted scorers, then a picker (docs/configuration.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    filters: list[RoutingPlugin] = Field(default_factory=_default_filters, description="engines left out, in order")
    scorers: list[RoutingPlugin] = Field(default_factory=list, description="weighted scores of those left")
    picker: RoutingPlugin = Field(
        default_factory=lambda: RoutingPlugin(type="max-score"), description="the pick among the scored"
    )
