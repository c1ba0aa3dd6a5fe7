"""The plugin on vLLM >= 0.33: only the GPUs, through vLLM's own endpoint-plugin seam.

vLLM 0.33 streams D's handle natively, so nothing is patched there (``hooks``); but a router still cannot
tell from vLLM's HTTP surface which GPUs an engine computes on (``gpus``). 0.33 loads ``vllm.endpoint_plugins``
entry points in its API server, when named in ``VLLM_PLUGINS`` (they are opt-in there): ``attach_router`` is
called while the app is built, ``init_state`` once the server's arguments are known. This one adds the
``x-turnkv-plugin`` header (``0.1.0; streams=; gpus=GPU-...``) to every response from then on. It adds no
route and never touches the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_turnkv.middleware import HEADER, AdvertiseMiddleware, header_value

log = logging.getLogger("vllm.turnkv")


class TurnkvEndpoint:
    """vLLM's ``EndpointPlugin`` shape (``vllm/plugins/endpoint_plugins/interface.py``)."""

    name = "turnkv"
    required_tasks: tuple[str, ...] | None = None  # any server, render-only ones included

    def __init__(self) -> None:
        self.value: str | None = None

    def attach_router(self, app: Any) -> None:
        from vllm_turnkv.hooks import add_middleware

        add_middleware(app, AdvertiseMiddleware, value=lambda: self.value)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from vllm_turnkv import __version__
        from vllm_turnkv.hooks import server_gpus

        gpus = server_gpus(args)
        if gpus:
            self.value = header_value(__version__, [], gpus)
            log.info("turnkv plugin: responses say %s: %s", HEADER, self.value)
        else:
            log.info("turnkv plugin: no GPU of this server could be read; not advertising %s", HEADER)
