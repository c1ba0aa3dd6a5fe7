"""Which engine serves a request: filters, scorers and a picker, as small plugins registered by name
(``plugins``) and combined into named profiles (``router``), run over a snapshot of the engines
(``base.InstanceView``). Pure decisions: the gateway's fleet takes the snapshots."""

from turnkv.routing.base import InstanceView, RouteRequest
from turnkv.routing.router import Router, build_profile

__all__ = ["InstanceView", "RouteRequest", "Router", "build_profile"]
