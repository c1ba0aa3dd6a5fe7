"""What the doctor concludes: one ``Finding`` per item checked, each with its verdict and, where something
is wrong, what to do about it.

``FAIL`` is a blocking problem (the deployment would serve wrong answers, fail turns, or never reuse
KV at all): ``turnkv doctor`` then exits 1, so it can gate a deployment. ``WARN`` works but loses
speed or memory; ``INFO`` is a fact worth seeing; ``SKIPPED`` says what was not checked and why.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class Verdict(enum.StrEnum):
    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"
    SKIPPED = "skipped"


class Item(enum.StrEnum):
    """What a finding is about: stable codes, as reason codes are."""

    REACHABLE = "reachable"
    MODELS = "models"
    VERSIONS = "versions"
    BLOCK_SIZE = "block_size"
    CONNECTOR = "connector"
    BIDIRECTIONAL = "bidirectional"
    TOKENIZER = "tokenizer"
    PLUGIN = "plugin"
    GPUS = "gpus"
    SIDE_CHANNEL = "side_channel"
    UNEXPOSED = "unexposed"
    TEMPLATE = "template"
    RENDER = "render"
    PROBE = "probe"  # the probe's own turns
    LINK_P_TO_D = "link_p_to_d"
    LINK_D_TO_P = "link_d_to_p"
    TRANSPORTS = "transports"
    PULL_PAYS = "pull_pays"
    KV_BYTES = "kv_bytes_per_token"
    DECODE_MEMORY = "decode_memory"


@dataclass(frozen=True)
class Finding:
    item: Item
    verdict: Verdict
    summary: str
    fix: str | None = None
    engine: str | None = None  # the engine it is about, when one
    data: Mapping[str, Any] = field(default_factory=dict)


def blocking(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.verdict is Verdict.FAIL]


def exit_status(findings: Sequence[Finding]) -> int:
    """0: nothing blocks the deployment; 1: something does."""
    return 1 if blocking(findings) else 0
