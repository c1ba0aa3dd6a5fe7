"""Structured logs: a structlog logger per app, writing one JSON (or key=value) line per event.

JSON lines are encoded with orjson (compact; a turn's event is written on every turn, and the stdlib
encoder was most of its cost); what orjson cannot encode goes through the stdlib, anything not JSON as
its ``str`` either way.

Operational events (``store.down``, ``instance.unhealthy``, ``shutdown.draining``...) are logged through
the standard library as ``log.warning("store.down op=%s why=%s", op, why)``: with ``log_json`` the
process's handler (``configure_stdlib``) writes each as one JSON object, its fields typed
(``{"event": "store.down", "op": "claim", "why": "failures", ...}``); a line in another shape (a
library's) becomes ``{"event": "log", "message": ...}``.
"""

from __future__ import annotations

import json as stdjson
import logging
import re
import sys
from collections.abc import MutableMapping
from datetime import UTC, datetime
from typing import Any

import orjson
import structlog

_EVENT = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+")  # store.down, shutdown.draining
_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=%[-#0 +]*\d*(?:\.\d+)?[sdifrx]")
_RESERVED = frozenset({"timestamp", "level", "logger", "event"})


def event_fields(msg: object, args: object) -> dict[str, Any] | None:
    """``("store.down op=%s why=%s", ("claim", "failures"))`` -> ``{"event": "store.down", "op": "claim",
    "why": "failures"}``; text after the fields and ": " is the event's ``message``. None for a message in
    any other shape."""
    if not isinstance(msg, str):
        return None
    values = args if isinstance(args, tuple) else ()
    head, sep, text = msg.partition(": ")
    if "%" in text:
        return None
    name, *tokens = head.split(" ")
    if not _EVENT.fullmatch(name):
        return None
    out: dict[str, Any] = {"event": name, **({"message": text} if sep else {})}
    left = list(values)
    for token in tokens:
        m = _FIELD.fullmatch(token)
        if m is not None and left:
            value = left.pop(0)
            key = m.group(1)
            value = value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
        else:  # key=literal
            key, eq, value = token.partition("=")
            if not eq or "%" in token or not key.isidentifier():
                return None
        if key in _RESERVED:
            return None
        out[key] = value
    return None if left else out


class JsonLines(logging.Formatter):
    """One JSON object a record: timestamp, level, logger and the event's fields (``event_fields``). A line
    that is a JSON object already (a structlog event) is written as it is."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.msg
        if isinstance(msg, str) and msg.startswith("{") and not record.args and not record.exc_info:
            return msg
        line: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        line.update(event_fields(msg, record.args) or {"event": "log", "message": record.getMessage()})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _json_line(line)


def configure_stdlib(level: str, *, json: bool = False) -> None:
    """Called by the command line only: the process's root logger prints to stderr, one JSON object a line
    with ``json`` (``JsonLines``), else the message alone. No record looks up its caller's frame, thread or
    process (the logging HOWTO's "Optimization" switches): a turn's log event costs that on every turn
    otherwise."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if json else logging.Formatter("%(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
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
