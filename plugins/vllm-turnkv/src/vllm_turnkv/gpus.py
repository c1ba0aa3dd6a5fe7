"""Which GPUs this vLLM server computes on, named so that another process can tell whether it shares them.

A router cannot tell from vLLM's HTTP surface whether a prefill engine and a decode engine run on the same
GPU, and that decides whether a prefill on P slows D's streams as a prefill on D would. Device indices do
not say it: ``CUDA_VISIBLE_DEVICES`` renumbers them per process and a container sees its own subset. The
UUIDs NVML reports (``GPU-...``; ``MIG-...`` for a MIG instance, whose compute is its own) are the same
from every process, container and host, so the plugin advertises those (``x-turnkv-plugin: ...;
gpus=GPU-...``) and a router compares them.

Which devices: vLLM gives its workers the visible devices in order, so a server computes on the first
``tensor_parallel_size x pipeline_parallel_size x data-parallel ranks on this node`` of them; visible are
the entries of ``CUDA_VISIBLE_DEVICES`` (indices into NVML's list, or UUIDs already), or every device NVML
lists when it is unset. Indices are resolved with NVML (as vLLM's ``device_id_to_physical_device_id`` and
``get_device_uuid`` do), in the API server process, which initialises no CUDA context for it. Whatever
cannot be read gives no list, and the router then knows what it knows without the plugin: nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger("vllm.turnkv")
UUID_PREFIXES = ("GPU-", "MIG-")


class Nvml(Protocol):
    """What is used of ``pynvml`` (nvidia-ml-py), the module vLLM itself reads GPUs with."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...


def devices_used(args: Any) -> int:
    """How many of the visible devices the server computes on, from ``vllm serve``'s arguments."""

    def size(name: str) -> int:
        v = getattr(args, name, None)
        return v if isinstance(v, int) and v > 0 else 1

    dp_local = getattr(args, "data_parallel_size_local", None)
    dp = dp_local if isinstance(dp_local, int) and dp_local > 0 else size("data_parallel_size")
    return size("tensor_parallel_size") * size("pipeline_parallel_size") * dp


def load_nvml() -> Nvml | None:
    """vLLM's own pynvml (vLLM 0.26 imports it through ``import_pynvml``), else nvidia-ml-py's."""
    try:
        from vllm.utils.import_utils import import_pynvml  # type: ignore[import-not-found]

        return import_pynvml()  # type: ignore[no-any-return]
    except Exception:
        pass
    try:
        import pynvml  # type: ignore[import-not-found]

        return pynvml  # type: ignore[no-any-return]
    except Exception:
        return None


def engine_gpus(args: Any, visible: str | None, nvml: Nvml | None) -> list[str]:
    """The UUIDs of the devices the server computes on (``visible``: ``CUDA_VISIBLE_DEVICES``; None:
    unset), or [] where they cannot be known."""
    entries = [e.strip() for e in visible.split(",")] if visible is not None and visible.strip() else None
    used = devices_used(args)
    if entries is not None and all(e.startswith(UUID_PREFIXES) for e in entries[:used]):
        return entries[:used]  # named already: nothing to resolve
    if nvml is None:
        return []
    try:
        nvml.nvmlInit()
    except Exception as exc:
        log.info("turnkv plugin: NVML unavailable (%s); not advertising this server's GPUs", exc)
        return []
    try:
        return _resolve(nvml, entries, used)
    except Exception as exc:
        log.info("turnkv plugin: could not read this server's GPUs from NVML (%s)", exc)
        return []
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _resolve(nvml: Nvml, entries: Sequence[str] | None, used: int) -> list[str]:
    if entries is None:
        entries = [str(i) for i in range(nvml.nvmlDeviceGetCount())]
    out: list[str] = []
    for e in entries[:used]:
        if e.startswith(UUID_PREFIXES):
            out.append(e)
            continue
        uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(int(e)))
        out.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
    return out
