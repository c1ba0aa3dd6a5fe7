"""The header on vLLM >= 0.33, through vLLM's own endpoint-plugin seam.

vLLM 0.33 streams D's handle natively on chat and completions, so only the tokens-only generate stream is
patched there (``hooks``); and a router still cannot tell from vLLM's HTTP surface which GPUs an engine
computes on (``gpus``). 0.33 loads ``vllm.endpoint_plugins`` entry points in its API server, when named in
``VLLM_PLUGINS`` (they are opt-in there): ``attach_router`` is called while the app is built, ``init_state``
once the server's arguments are known. This one adds the ``x-turnkv-plugin`` header (``0.1.0;
streams=generate; gpus=GPU-...``) to every response from then on: ``streams`` what ``hooks`` patched in this
process, as it stands when a response is sent. It adds no route and never touches the engine.
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
        self.gpus: list[str] | None = None  # None until the server's arguments are known

    def value(self) -> str | None:
        from vllm_turnkv import __version__
        from vllm_turnkv.hooks import STATE

        if self.gpus is None or not (self.gpus or STATE.patched):
            return None
        return header_value(__version__, STATE.patched, self.gpus)

    def attach_router(self, app: Any) -> None:
        from vllm_turnkv.hooks import add_middleware

        add_middleware(app, AdvertiseMiddleware, value=self.value)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from vllm_turnkv.hooks import server_gpus

        self.gpus = server_gpus(args)
        value = self.value()
        if value is not None:
            log.info("turnkv plugin: responses say %s: %s", HEADER, value)
        else:
            log.info("turnkv plugin: no GPU could be read, no stream patched; not advertising %s", HEADER)
