"""P's refusal of the one-token prefill turnkv sends it, restated as the client's own request would have
heard it.

P gets ``max_tokens: 1`` (vLLM's P/D protocol): a prompt too long for the model is refused with P's numbers
("you requested 1 output tokens ... for a total of N+1 tokens"), which are not the client's. The refusal
keeps the engine's reason and words, with the output length the client asked for and the total that
makes (vLLM 0.26 to 0.33 word it alike; a message in any other wording is passed on as it is).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from turnkv.errors import UpstreamStatus

_CONTEXT = re.compile(
    r"you requested \d+ output tokens and your prompt contains (at least )?(\d+) input tokens, "
    r"for a total of (at least )?\d+ tokens"
)


def asked_output(body: Mapping[str, Any]) -> int:
    """The output length the client asked for (vLLM reads an unset one as 0 in this message)."""
    out = body.get("max_completion_tokens") or body.get("max_tokens")
    return out if isinstance(out, int) and not isinstance(out, bool) else 0


def as_client_asked(exc: UpstreamStatus, client: Mapping[str, Any]) -> UpstreamStatus:
    """``exc`` (P's 4xx) with the client's output length where P's message names the prefill's own."""
    body = exc.upstream_body
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return exc
    error = body["error"]
    message = error.get("message")
    if not 400 <= exc.upstream_status < 500 or not isinstance(message, str):
        return exc
    asked = asked_output(client)

    def restated(m: re.Match[str]) -> str:
        least, prompt = m.group(1) or "", int(m.group(2))
        return (
            f"you requested {asked} output tokens and your prompt contains {least}{prompt} input tokens, "
            f"for a total of {least}{prompt + asked} tokens"
        )

    said = _CONTEXT.sub(restated, message)
    if said == message:
        return exc
    new = {**body, "error": {**error, "message": said}}
    return UpstreamStatus(exc.upstream_status, new, leg=exc.leg, instance=exc.instance)
