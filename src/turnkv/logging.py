"""Structured logs: a structlog logger per app, writing one JSON (or key=value) line per event.

JSON lines are encoded with orjson (compact; a turn's event is written on every turn, and the stdlib
encoder was most of its cost); what orjson cannot encode goes through the stdlib, anything not JSON as
its ``str`` either way.
"""

from __future__ import annotations

import json as stdjson
import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import orjson
import structlog


def configure_stdlib(level: str) -> None:
    """Called by the command line only: the process's root logger prints plain lines to stderr. They say
    only their message, so no record looks up its caller's frame, thread or process (the logging HOWTO's
    "Optimization" switches): a turn's log event costs that on every turn otherwise."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(message)s")
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def make_logger(name: str = "turnkv", *, json: bool = True) -> Any:
    renderer: Any = (
        structlog.processors.JSONRenderer(serializer=_json_line)
        if json
        else structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=False)
    )
    # bound once here: the lazy proxy ``wrap_logger`` returns assembles a new logger on every call
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _drop_none,
            renderer,
        ],
    ).bind()


def _drop_none(logger: Any, method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if v is not None}


def _json_line(event: Any, **_: Any) -> str:
    try:
        return orjson.dumps(event, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    except orjson.JSONEncodeError:  # integers past 64 bits
        return stdjson.dumps(event, default=str, ensure_ascii=False)
