"""The engine seam: what turnkv asks of an inference engine (``base.Engine``), and the engines behind it.

``vllm`` speaks vLLM's HTTP API and P/D protocol; ``fourhop`` the same engines run ``--tokens-only`` behind a
render service; ``mock`` is a double whose answers a handler function
scripts, for tests. ``open_engine`` builds the one ``settings.engine`` names, with whatever it owns (an
HTTP session) closed when the gateway stops; the gateway and ``turnkv check-template`` open engines only
through it. docs/extending.md says how to add an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from turnkv.config import ConfigError, Settings
from turnkv.engine.base import Engine
from turnkv.engine.fourhop import fourhop_engine
from turnkv.engine.vllm import vllm_engine

ENGINES: dict[str, Callable[[Settings], AbstractAsyncContextManager[Engine]]] = {
    "vllm": vllm_engine,
    "vllm-four-hop": fourhop_engine,  # a render service, tokens-only P and D, derender
}


def open_engine(settings: Settings) -> AbstractAsyncContextManager[Engine]:
    try:
        factory = ENGINES[settings.engine]
    except KeyError:
        raise ConfigError(f"unknown engine {settings.engine!r}; known: {', '.join(ENGINES)}") from None
    return factory(settings)


__all__ = ["ENGINES", "Engine", "open_engine"]
