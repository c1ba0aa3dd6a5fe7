"""Operational log events are structured: each ``log.<level>("name k=%s ...", ...)`` of the gateway
becomes one JSON object with typed fields (``turnkv.logging.JsonLines``)."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest

from turnkv.logging import JsonLines, event_fields

SRC = Path(__file__).resolve().parents[2] / "src" / "turnkv"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
SCOPE = ("gateway", "state", "engine", "launch.py", "logging.py")


def stdlib_events() -> list[tuple[str, str, int]]:
    """(place, format string, number of arguments) of every stdlib log call with an event name."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if not str(path.relative_to(SRC)).startswith(SCOPE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            if node.func.attr not in LEVELS or not (isinstance(target, ast.Name) and target.id in {"log", "logger"}):
                continue
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                place = f"{path.relative_to(SRC)}:{node.lineno}"
                found.append((place, node.args[0].value, len(node.args) - 1))
    return found


def test_every_operational_event_of_the_gateway_reads_as_fields() -> None:
    events = stdlib_events()
    assert len(events) > 20
    for place, msg, n in events:
        if "." not in msg.split(" ")[0]:
            continue  # not an event name: a message imitating another program's (the simulator's)
        assert event_fields(msg, tuple(range(n))) is not None, f"{place}: {msg!r} is not 'name key=%s ...'"


@pytest.mark.parametrize(
    ("msg", "args", "fields"),
    [
        ("store.down op=%s why=%s", ("claim", "failures"), {"event": "store.down", "op": "claim", "why": "failures"}),
        (
            "shutdown.draining turns=%d drain_s=%.1f",
            (3, 30.0),
            {"event": "shutdown.draining", "turns": 3, "drain_s": 30.0},
        ),
        ("background.not_stopped tasks=%s", ([1, 2],), {"event": "background.not_stopped", "tasks": "[1, 2]"}),
        ("Started server process [%d]", (7,), None),
        ("store.down op=%s", (), None),
        ("store.down level=%s", ("x",), None),  # a field would overwrite the line's own
    ],
)
def test_a_message_reads_as_an_event_or_not_at_all(msg: str, args: tuple[object, ...], fields: object) -> None:
    assert event_fields(msg, args) == fields


def test_a_record_is_one_json_line() -> None:
    fmt = JsonLines()
    rec = logging.LogRecord("turnkv.store", logging.WARNING, __file__, 1, "store.down op=%s", ("claim",), None)
    line = json.loads(fmt.format(rec))
    assert line.pop("timestamp").endswith("Z")
    assert line == {"level": "warning", "logger": "turnkv.store", "event": "store.down", "op": "claim"}
    other = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started server process [%d]", (7,), None)
    assert json.loads(fmt.format(other))["message"] == "Started server process [7]"
    already = logging.LogRecord("turnkv.turn", logging.INFO, __file__, 1, '{"event":"turn"}', (), None)
    assert fmt.format(already) == '{"event":"turn"}'
