"""The long-lived objects a turn uses, built once per app in its lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from turnkv.config import Settings
from turnkv.engine.base import Engine
from turnkv.gateway.lifecycle import Drain
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.gateway.pins import PinKeeper
from turnkv.gateway.registry import Registry
from turnkv.gateway.release import Releaser
from turnkv.reuse.assess import TemplateClass
from turnkv.reuse.estimator import CostEstimator
from turnkv.reuse.policies import ReusePolicy
from turnkv.state.guard import StoreGuard


@dataclass
class TemplateAudit:
    cls: TemplateClass = TemplateClass.UNKNOWN
    detail: str = "not audited yet"


@dataclass
class Services:
    settings: Settings
    engine: Engine
    registry: Registry
    store: StoreGuard
    policy: ReusePolicy
    estimator: CostEstimator
    metrics: GatewayMetrics
    log: Any  # a structlog BoundLogger
    releaser: Releaser
    pins: PinKeeper
    drain: Drain
    audit: TemplateAudit = field(default_factory=TemplateAudit)
    models: list[str] = field(default_factory=list)
    model_len: dict[str, int] = field(default_factory=dict)  # the engines' max_model_len per model name
