"""Shared by the examples: where the gateway is, and an HTTP hook that prints what turnkv decided for
each model call, from the response headers every turn carries. Nothing here tells turnkv anything:
the examples send no conversation id (no X-Session-ID); turnkv finds the conversation itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import openai

BASE_URL = os.environ.get("TURNKV_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1"
MODEL = os.environ.get("TURNKV_MODEL", "sim-model")
API_KEY = os.environ.get("OPENAI_API_KEY", "turnkv-example")
SYSTEM = ("You are a travel planning agent. Work step by step, call the lookup tool when you need facts about "
          "places, prices or opening times, and keep every answer short. ") * 6
TASKS = ["Plan two days in Lyon for me.", "What about the evening of day one?",
         "Is the museum open on Monday?", "Find a cheaper hotel near the station.",
         "Summarise the plan in three lines."]


def lookup_fact(topic: str) -> str:
    """What the examples' lookup tool answers: a fixed fact, so runs are repeatable."""
    return f"{topic}: open daily 9-18, entry 12 EUR, 10 minutes from the station."


class Decisions:
    """Prints one line per model call: turnkv's outcome, action and reason, and where the conversation
    came from (``x-turnkv-conversation``: digest, response, header, ...)."""

    def __init__(self) -> None:
        self.calls = 0

    def show(self, response: Any) -> None:
        h = response.headers
        if "x-turnkv-outcome" not in h:
            return
        self.calls += 1
        print(f"  [turnkv] call {self.calls:>2}: {h['x-turnkv-outcome']:<12} {h.get('x-turnkv-action', ''):<12} "
              f"{h.get('x-turnkv-reason', ''):<20} conversation={h.get('x-turnkv-conversation', '?'):<8} "
              f"prompt={h.get('x-turnkv-prompt-tokens', '?')} "
              f"planned_pull={h.get('x-turnkv-planned-pull-tokens', '?')}",
              flush=True)

    async def ashow(self, response: Any) -> None:
        self.show(response)

    def client(self) -> Any:
        return openai.DefaultHttpxClient(event_hooks={"response": [self.show]})

    def async_client(self) -> Any:
        return openai.DefaultAsyncHttpxClient(event_hooks={"response": [self.ashow]})

    def done(self) -> None:
        print(f"turnkv-example-calls: {self.calls}", flush=True)
        if self.calls == 0:
            sys.exit("no model call went through turnkv")
