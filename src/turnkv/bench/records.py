"""What is recorded per request, and the result files: one JSON document per run.

A run holds configurations; each configuration holds its workload, where the load went, what was
measured about the deployment (gateway CPU, metrics), and one record per request.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
DECISION_HEADERS = (
    "x-turnkv-outcome",
    "x-turnkv-action",
    "x-turnkv-reason",
    "x-turnkv-matched-tokens",
    "x-turnkv-direct",
    "x-turnkv-ahead",
)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are milliseconds; ``start_s`` is from the run's start."""

    conversation: int
    turn: int
    start_s: float
    ttft_ms: float | None = None
    latency_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    decision: dict[str, str] = field(default_factory=dict)  # x-turnkv-* headers, prefix removed

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["itl_ms"] = [round(x, 3) for x in self.itl_ms]
        for k in ("ttft_ms", "latency_ms", "start_s"):
            if d[k] is not None:
                d[k] = round(d[k], 3)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**d)


@dataclass
class ConfigResult:
    """One configuration of a run: its name, what it was, and its requests."""

    name: str
    description: str
    workload: dict[str, Any]
    target: dict[str, Any]
    requests: list[RequestRecord]
    wall_s: float
    meta: dict[str, Any] = field(default_factory=dict)
    group: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "description": self.description,
            "workload": self.workload,
            "target": self.target,
            "wall_s": round(self.wall_s, 3),
            "meta": self.meta,
            "requests": [r.to_dict() for r in self.requests],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConfigResult:
        return cls(
            name=d["name"],
            group=d.get("group", ""),
            description=d.get("description", ""),
            workload=d.get("workload", {}),
            target=d.get("target", {}),
            wall_s=d.get("wall_s", 0.0),
            meta=d.get("meta", {}),
            requests=[RequestRecord.from_dict(r) for r in d["requests"]],
        )


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "turnkv_source": revision(),
    }


def revision() -> str:
    """Which turnkv code ran: ``TURNKV_BENCH_REVISION`` if set, else the git commit of the package's tree."""
    given = os.environ.get("TURNKV_BENCH_REVISION")
    if given:
        return given
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "."], cwd=here.parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+uncommitted changes" if dirty.stdout.strip() else "")


@dataclass
class RunResult:
    """Everything one ``turnkv bench`` invocation measured."""

    suite: str
    command: str
    configs: list[ConfigResult] = field(default_factory=list)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    machine: dict[str, Any] = field(default_factory=machine)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "tool": "turnkv bench",
            "suite": self.suite,
            "command": self.command,
            "created": self.created,
            "machine": self.machine,
            "extra": self.extra,
            "configs": [c.to_dict() for c in self.configs],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        return cls(
            suite=d["suite"],
            command=d["command"],
            created=d["created"],
            machine=d["machine"],
            extra=d.get("extra", {}),
            configs=[ConfigResult.from_dict(c) for c in d["configs"]],
        )

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> RunResult:
        return cls.from_dict(json.loads(path.read_text()))
