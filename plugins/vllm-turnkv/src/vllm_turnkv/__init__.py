"""turnkv's vLLM plugin: D's ``kv_transfer_params`` on the final SSE chunk, as vLLM 0.33's chat streams send it.

Chat and completions streams on vLLM 0.26-0.32; tokens-only ``/inference/v1/generate`` streams on every
version from 0.26 (none streams the handle there).

Registered as the ``vllm.general_plugins`` entry point ``turnkv`` (vLLM calls ``register`` in every
process). Without entry points, call ``vllm_turnkv.register()`` before vLLM's API server starts, or
run the server through ``python -m vllm_turnkv serve ...`` (same arguments as ``vllm serve``).
See README.md.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "register"]


def register() -> None:
    """The entry point: patch what this process has of vLLM's OpenAI server (see ``hooks``)."""
    from vllm_turnkv.hooks import install

    install()
