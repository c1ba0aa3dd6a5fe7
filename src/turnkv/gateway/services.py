"""The long-lived objects a turn uses, built once per app in its lifespan and never replaced.

``Catalog`` is what the engines said about what they serve (model names, context lengths) and what the
start-up audit found of the chat template; the audit is its only writer, and readers see whole values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from turnkv.config import Settings
from turnkv.engine.base import Engine
from turnkv.errors import UpstreamUnavailable
from turnkv.gateway.decode_admission import DecodeAdmission
from turnkv.gateway.fleet import Fleet
from turnkv.gateway.lifecycle import Drain
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.gateway.pins import PinKeeper
from turnkv.gateway.release import Releaser
from turnkv.gateway.writeback import WriteBacks
from turnkv.reuse.assess import TemplateClass
from turnkv.reuse.decision import ReusePolicy
from turnkv.reuse.estimator import CostEstimator
from turnkv.routing import Router
from turnkv.state.guard import StoreGuard


@dataclass(frozen=True)
class TemplateAudit:
    cls: TemplateClass = TemplateClass.UNKNOWN
    detail: str = "not audited yet"


@dataclass
class Catalog:
    models: list[str] = field(default_factory=list)  # served model names, as the engines list them
    model_len: dict[str, int] = field(default_factory=dict)  # the engines' max_model_len per model name
    template: TemplateAudit = field(default_factory=TemplateAudit)

    def learned(self, models: list[str], model_len: dict[str, int]) -> None:
        self.models, self.model_len = models, model_len

    def audited(self, audit: TemplateAudit) -> None:
        self.template = audit


@dataclass(frozen=True)
class Services:
    settings: Settings
    engine: Engine
    fleet: Fleet
    router: Router
    store: StoreGuard
    policy: ReusePolicy
    estimator: CostEstimator
    metrics: GatewayMetrics
    log: Any  # a structlog BoundLogger
    releaser: Releaser
    pins: PinKeeper
    write_backs: WriteBacks
    admission: DecodeAdmission
    drain: Drain
    catalog: Catalog = field(default_factory=Catalog)

    @property
    def models(self) -> list[str]:
        """The model names requests may name: the configured ones, else what the engines serve."""
        return self.settings.models or self.catalog.models

    def render_base(self) -> str:
        """Where renders, the template audit and the engine API passed through go: the render service, else
        a prefill engine the router picks. None to pick is a server condition (``UpstreamUnavailable``, a
        503): a turn that meets it renders nothing and loses its reuse, a passed-through call fails with it,
        the audit tries again later."""
        if self.settings.render:
            return self.settings.render
        inst = self.router.pick("prefill")
        if inst is None:
            raise UpstreamUnavailable("no prefill engine is available to render", leg="render")
        return inst.url
