"""Structured logs: a structlog logger per app, writing one JSON (or key=value) line per event."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


def configure_stdlib(level: str) -> None:
    """Called by the command line only: the process's root logger prints plain lines to stderr."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(message)s")


def make_logger(name: str = "turnkv", *, json: bool = True) -> Any:
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=False)
    )
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _drop_none,
            renderer,
        ],
    )


def _drop_none(logger: Any, method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if v is not None}
