"""Which GPUs the plugin says a server computes on: the devices vLLM would give its workers, named by NVML UUID."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm_turnkv.gpus import devices_used, engine_gpus
from vllm_turnkv.middleware import header_value, parse_header_value

UUIDS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]


class FakeNvml:
    """NVML's list of a four-GPU host; ``fail`` makes nvmlInit raise, as without a driver."""

    def __init__(self, fail: bool = False, as_bytes: bool = False) -> None:
        self.fail, self.as_bytes = fail, as_bytes
        self.open = 0

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(UUIDS)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return UUIDS[index]  # IndexError past the end, as NVML's invalid-argument error

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return handle.encode() if self.as_bytes else handle


def args(tp: int = 1, pp: int = 1, dp: int = 1, dp_local: int | None = None) -> Any:
    return SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, data_parallel_size_local=dp_local
    )


@pytest.mark.parametrize(
    ("a", "n"),
    [(args(), 1), (args(tp=2), 2), (args(tp=2, pp=2), 4), (args(dp=4), 4), (args(dp=4, dp_local=2), 2), (None, 1)],
)
def test_devices_used(a: Any, n: int) -> None:
    assert devices_used(a) == n


@pytest.mark.parametrize(
    ("visible", "a", "expect"),
    [
        (None, args(), ["GPU-aaaa"]),  # unset: vLLM starts at the first device NVML lists
        (None, args(tp=2), ["GPU-aaaa", "GPU-bbbb"]),
        ("", args(), ["GPU-aaaa"]),  # empty is unset, as vLLM reads it
        ("2,3", args(), ["GPU-cccc"]),  # indices are NVML's, whatever this process numbers them
        ("3, 1", args(tp=2), ["GPU-dddd", "GPU-bbbb"]),
        ("GPU-zzzz,1", args(tp=2), ["GPU-zzzz", "GPU-bbbb"]),
        ("MIG-1234", args(), ["MIG-1234"]),  # a MIG instance is its own compute
        ("7", args(), []),  # no such device: nothing said rather than a guess
        ("1,x", args(tp=2), []),
    ],
)
def test_the_devices_the_server_computes_on(visible: str | None, a: Any, expect: list[str]) -> None:
    nvml = FakeNvml()
    assert engine_gpus(a, visible, nvml) == expect
    assert nvml.open == 0  # NVML shut down again


def test_uuids_given_in_the_environment_need_no_nvml() -> None:
    assert engine_gpus(args(), "GPU-eeee,GPU-ffff", None) == ["GPU-eeee"]
    assert engine_gpus(args(), "0", None) == []
    assert engine_gpus(args(), None, FakeNvml(fail=True)) == []


def test_bytes_from_an_old_nvml_are_decoded() -> None:
    assert engine_gpus(args(), "1", FakeNvml(as_bytes=True)) == ["GPU-bbbb"]


def test_the_header_round_trips() -> None:
    v = header_value("0.1.0", ["chat", "completions"], ["GPU-aaaa", "GPU-bbbb"])
    assert v == "0.1.0; streams=chat,completions; gpus=GPU-aaaa,GPU-bbbb"
    adv = parse_header_value(v)
    assert adv is not None and adv.gpus == {"GPU-aaaa", "GPU-bbbb"} and adv.streams == {"chat", "completions"}
    assert header_value("0.1.0", ["chat"], []) == "0.1.0; streams=chat"
    old = parse_header_value("0.1.0; streams=chat")
    assert old is not None and old.gpus == frozenset()
    assert parse_header_value("") is None and parse_header_value("; streams=chat") is None
