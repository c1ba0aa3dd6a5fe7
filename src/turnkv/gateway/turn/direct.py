"""DIRECT: the messages held against the stored record without a render, and their size estimated from text.

A decode-local turn uses no handle: D serves it from its own prefix cache, which vLLM keys by the hashes of
the token ids themselves, so it is correct whatever the prompt turned out to be. The token check guards
pulls, not this. What rendering gives a decode-local turn is only the size of the new part, for the
policy's cost estimate; this module estimates it from the new messages' bytes instead (``Candidate``), so
that the SHORTCUT step (``turn.shortcut``) can plan the turn without the render call, which otherwise sits
on the turn's critical path. Only where nothing suggests the history was rewritten: the template preserves
history, the client echoed the last answer exactly as D produced it, and the history before it digests as
stored (``history_digest``). CAPTURE stores those digests, and still builds the next record from D's own
token ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnkv import jsonwire
from turnkv.gateway.services import Services
from turnkv.openai.answer import EchoedAnswer, echoed_answer, last_assistant
from turnkv.reuse.assess import TemplateClass

# Text bytes per token: measured on the conversation itself at each capture (its messages' bytes over
# its prompt's tokens), and used with a margin; before any measurement, a low guess (English runs ~4,
# CJK ~3: a character, ~1 token; hex, base64 and JSON 2-3). Digits are a token each in Qwen-style
# tokenizers, so they are counted apart.
BYTES_PER_TOKEN = 2.5
MARGIN = 1.25  # the new text may tokenize worse than the history did
TOKENS_PER_MESSAGE = 8  # role markers and separators the template adds
# request fields besides the messages that change the prompt the template renders
PROMPT_FIELDS = (
    "model",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "cache_salt",
    "reasoning_effort",
)


def history_digest(body: Mapping[str, Any], messages: Sequence[Any]) -> str:
    """Digest of ``messages`` with the request fields that shape the prompt; equal digests, equal prompts
    up to the end of these messages (the client sent the same history, tools and template options)."""
    doc = {"messages": list(messages), **{k: body[k] for k in PROMPT_FIELDS if k in body}}
    return hashlib.blake2b(jsonwire.dumps_sorted(doc), digest_size=16).hexdigest()


_DIGITS = b"0123456789"  # tokenizers give each its own token


def _content_size(content: Any) -> tuple[int, int] | None:
    """(digits, other UTF-8 bytes) of a message's text; None for parts that are not text (an image is
    many tokens)."""
    texts: list[str] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            texts.append(part["text"])
    elif content is not None:
        return None
    raw = [t.encode("utf-8") for t in texts]
    size = sum(len(b) for b in raw)
    other = sum(len(b.translate(None, _DIGITS)) for b in raw)  # in C: histories run to 100s of KB
    return size - other, other


def text_size(messages: Sequence[Any]) -> tuple[int, int] | None:
    """(digits, other bytes) of the messages' text; None when one is not a message of text."""
    total_d = total_b = 0
    for m in messages:
        size = _content_size(m.get("content")) if isinstance(m, Mapping) else None
        if size is None:
            return None
        total_d, total_b = total_d + size[0], total_b + size[1]
    return total_d, total_b


# a prompt not rendered (a first turn) is sized from its text for P's queue and routing: English ~4 bytes a token
SIZE_BYTES_PER_TOKEN = 4.0


def size_guess(messages: Sequence[Any]) -> int:
    """A likely (not a safe) token count of messages never rendered: for P's queue, not for a limit; 0 when
    one is not text."""
    size = text_size(messages)
    return 0 if size is None else size[0] + int(size[1] / SIZE_BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)


def bytes_per_token(messages: Sequence[Any], prompt_tokens: int) -> float | None:
    """What this conversation's text measured: its non-digit bytes per non-digit prompt token (the
    template's own tokens count in, which keeps the figure low, so estimates from it high)."""
    size = text_size(messages)
    if size is None or prompt_tokens - size[0] <= 0 or size[1] <= 0:
        return None
    return min(8.0, max(1.0, size[1] / (prompt_tokens - size[0])))


@dataclass(frozen=True)
class Candidate:
    """A turn that continues an answer with text only: what the record is held against."""

    echoed: EchoedAnswer
    answer_at: int  # index of the last assistant message
    new_messages: int  # messages after it
    new_size: tuple[int, int]  # their (digits, other bytes)

    def new_tokens(self, measured_bytes_per_token: float | None = None) -> int:
        """Tokens the new messages will add, rounded up."""
        bpt = measured_bytes_per_token / MARGIN if measured_bytes_per_token else BYTES_PER_TOKEN
        digits, other = self.new_size
        # the generation prompt, and the closing of the assistant turn the template re-emits
        return int(digits + other / bpt + 0.999) + TOKENS_PER_MESSAGE * (self.new_messages + 2)


def continuation(messages: Sequence[Any]) -> Candidate | None:
    """The messages as a continuation of their last answer with text only; None when there is no
    assistant message (nothing for D to continue), nothing after it, or a message is not text."""
    i = last_assistant(messages)
    if i is None:
        return None
    tail = messages[i + 1 :]
    if not tail or any(not isinstance(m, Mapping) or m.get("role") not in ("user", "tool", "system") for m in tail):
        return None
    size = text_size(tail)
    echoed = echoed_answer(messages)
    if size is None or echoed is None:
        return None
    return Candidate(echoed, i, len(tail), size)


def enabled(svc: Services, *, until_audited: bool = False) -> bool:
    """The setting is on and the template keeps history: direct turns are possible at all (with
    ``until_audited``, also while the start-up audit has not classified the template yet)."""
    ok = (TemplateClass.PRESERVES, TemplateClass.UNKNOWN) if until_audited else (TemplateClass.PRESERVES,)
    return svc.settings.decode_local_direct and svc.catalog.template.cls in ok
