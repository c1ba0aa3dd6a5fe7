"""The one place where routing plugins' type names map to their parameters and factories.

A plugin is named in a profile by its type (``affinity``), with optional ``params`` that its own
parameter model validates at start: a wrong name or parameter refuses the start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import ValidationError

from turnkv.errors import ConfigError
from turnkv.routing.base import Filter, NoParams, Params, Picker, Scorer
from turnkv.routing.filters import NotAvoided, NotTried, Routable
from turnkv.routing.pickers import MaxScore
from turnkv.routing.scorers import Affinity, AffinityParams, Load, LoadParams, PinHeadroom, Ttft

T = TypeVar("T")
Factory = tuple[type[Params], Callable[[Any], T]]

FILTERS: dict[str, Factory[Filter]] = {
    "not-tried": (NoParams, NotTried),
    "not-avoided": (NoParams, NotAvoided),
    "routable": (NoParams, Routable),
}
SCORERS: dict[str, Factory[Scorer]] = {
    "load": (LoadParams, Load),
    "affinity": (AffinityParams, Affinity),
    "pin-headroom": (NoParams, PinHeadroom),
    "ttft": (NoParams, Ttft),
}
PICKERS: dict[str, Factory[Picker]] = {
    "max-score": (NoParams, MaxScore),
}


def build(kind: str, registry: Mapping[str, Factory[T]], type_: str, params: Mapping[str, Any]) -> T:
    """The plugin ``type_`` of ``kind`` (filter, scorer, picker), its ``params`` validated."""
    try:
        model, factory = registry[type_]
    except KeyError:
        raise ConfigError(f"unknown routing {kind} {type_!r}; known: {', '.join(registry)}") from None
    try:
        return factory(model.model_validate(dict(params)))
    except ValidationError as exc:
        raise ConfigError(f"routing {kind} {type_}: {exc}") from exc
