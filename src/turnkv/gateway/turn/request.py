"""The turn a front end asks for: the client's request, checked, as the engines will get it. Frozen.

Chat completions (``routes``) and the Responses API (``responses``) build one from a validated body;
the pipeline reads the request's settings from here, never from the raw body again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv.engine.base import CallMeta
from turnkv.gateway.body import ChatBody, CompletionBody
from turnkv.gateway.identity import Conversation

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class Turn:
    request_id: str
    body: Mapping[str, Any]  # as the engines get it: turnkv's own fields removed, the tenant's cache salt set
    stream: bool
    meta: CallMeta  # the request id and the credentials engine calls carry
    conversation: Conversation | None
    index: int  # 1 + the assistant messages in the history
    path: str = CHAT_PATH  # the client's endpoint; P and D get the same one
    n: int = 1  # choices asked for
    max_output: int | None = None  # max_completion_tokens, else max_tokens
    return_token_ids: bool = False  # the client asked for token ids itself
    started: float = field(default_factory=time.perf_counter)

    @property
    def chat(self) -> bool:
        return self.path == CHAT_PATH

    @property
    def messages(self) -> Sequence[Any]:
        msgs = self.body.get("messages")
        return msgs if isinstance(msgs, list) else []

    @classmethod
    def of(
        cls,
        *,
        request_id: str,
        body: Mapping[str, Any],
        parsed: ChatBody | CompletionBody,
        authorization: str | None,
        conversation: Conversation | None,
    ) -> Turn:
        """The turn for ``body`` (as the engines get it), ``parsed`` being the client's body validated."""
        answers = sum(1 for m in parsed.messages if m.role == "assistant") if isinstance(parsed, ChatBody) else 0
        out = body.get("max_completion_tokens") or body.get("max_tokens")
        return cls(
            request_id=request_id,
            body=body,
            stream=bool(parsed.stream),
            meta=CallMeta(request_id, authorization),
            conversation=conversation,
            index=1 + answers,
            path=CHAT_PATH if isinstance(parsed, ChatBody) else COMPLETIONS_PATH,
            n=parsed.n or 1,
            max_output=out if isinstance(out, int) else None,
            return_token_ids=bool(parsed.return_token_ids),
        )
