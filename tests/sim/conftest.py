"""Fixtures for simulator tests that run real ``turnkv sim`` processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.sim.helpers import Sim
from turnkv import launch

StartSims = Callable[..., list[Sim]]


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30.0) as client:
        yield client


@pytest.fixture
def sims(procs: list[launch.Running], tmp_path: Path, http: httpx.Client) -> StartSims:
    """Start sims at time scale 0, all at once; each spec is ``(name, role, *flags)``."""

    def start(*specs: tuple[str, ...]) -> list[Sim]:
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [
                pool.submit(launch.sim, name, role, "--time-scale", "0", *flags, log_dir=tmp_path)
                for name, role, *flags in specs
            ]
            started: list[launch.Running] = []
            errors: list[BaseException] = []
            for f in futures:
                try:
                    started.append(f.result())
                except Exception as exc:  # every process that did start is still stopped at the end
                    errors.append(exc)
        procs.extend(started)
        if errors:
            raise errors[0]
        return [Sim(r.url, http) for r in started]

    return start
