"""P's refusal of turnkv's one-token prefill, restated with the client's own numbers (the engine's words)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turnkv.engine.vllm.refusals import as_client_asked
from turnkv.errors import UpstreamStatus

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.26.0" / "error_context_400.json"
SAID = (
    "This model's maximum context length is 40960 tokens. However, you requested 1 output tokens and your "
    "prompt contains {least}43200 input tokens, for a total of {least}43201 tokens. Please reduce the length of "
    "the input prompt or the number of requested output tokens. (parameter=input_tokens, value=43200)"
)


def refusal(message: str, status: int = 400) -> UpstreamStatus:
    body = {"error": {"message": message, "type": "BadRequestError", "param": "input_tokens", "code": status}}
    return UpstreamStatus(status, body, leg="prefill", instance="http://p")


@pytest.mark.parametrize(
    ("client", "least", "asked", "total"),
    [
        ({"max_tokens": 60}, "", 60, 43260),
        ({"max_completion_tokens": 500, "max_tokens": 9}, "at least ", 500, 43700),
        ({}, "", 0, 43200),
    ],
)
def test_the_refusal_names_the_clients_output_length(
    client: dict[str, Any], least: str, asked: int, total: int
) -> None:
    restated = as_client_asked(refusal(SAID.format(least=least)), client)
    expected = (
        f"you requested {asked} output tokens and your prompt contains {least}43200 input tokens, "
        f"for a total of {least}{total} tokens"
    )
    assert expected in restated.message and "requested 1 output" not in restated.message
    assert restated.body()["error"]["message"] == restated.message  # what the client gets: the engine's body
    assert restated.body()["error"]["param"] == "input_tokens" and restated.status == 400
    assert restated.message.startswith("This model's maximum context length is 40960 tokens.")


def test_vllm_0_26s_recorded_refusal_is_restated() -> None:
    message = next(e["message"] for e in _errors(json.loads(FIXTURE.read_text())))
    restated = as_client_asked(refusal(message), {"max_tokens": 7})
    said = "you requested 7 output tokens and your prompt contains 100 input tokens, for a total of 107 tokens"
    assert said in restated.message


def _errors(value: Any) -> list[dict[str, Any]]:
    """Every ``error`` object in a recorded exchange."""
    if isinstance(value, dict):
        found = [value["error"]] if isinstance(value.get("error"), dict) else []
        return found + [e for v in value.values() for e in _errors(v)]
    if isinstance(value, list):
        return [e for v in value for e in _errors(v)]
    return []


@pytest.mark.parametrize(
    "exc",
    [
        refusal("min_tokens must be in [0, max_tokens=1], got 5."),  # another refusal: as it was
        refusal(SAID.format(least=""), status=500),  # not a refusal
        UpstreamStatus(400, "not json", leg="prefill"),
    ],
)
def test_other_errors_pass_as_they_are(exc: UpstreamStatus) -> None:
    assert as_client_asked(exc, {"max_tokens": 60}) is exc
