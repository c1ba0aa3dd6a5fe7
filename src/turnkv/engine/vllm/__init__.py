"""vLLM behind the engine seam: its HTTP API, its P/D protocol and the differences between its versions.

``engine`` makes the calls, ``handles`` knows the shapes of ``kv_transfer_params``, ``stream`` reads an
answer (SSE or JSON) for the client and the next turn, ``info`` reads ``/metrics`` and ``/version``, and
``http`` is the one aiohttp session with its per-leg timeouts and error translation.
"""

from turnkv.engine.vllm.engine import VllmEngine, vllm_engine

__all__ = ["VllmEngine", "vllm_engine"]
