"""Synthetic conversations: what each turn says, and the shape of the load that sends them.

Text is made of the simulator tokenizer's synthetic words, each with a leading space, so a message
of N words is N tokens on the simulator (and roughly N on a real tokenizer); a caller that knows
which words are one token each on a real engine passes those instead (``vocab``), with any request
fields it needs (``extra_body``, e.g. ``allowed_token_ids`` so that answers re-tokenize exactly).
Every conversation draws its own words from a seeded generator: no two conversations share a
prefix, so a prefix cache only ever helps a conversation with its own history.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class WorkloadSpec:
    """The load: how many conversations, how long each message is, and how they arrive."""

    conversations: int = 8
    turns: int = 5
    system_tokens: int = 2000
    user_tokens: int = 150
    answer_tokens: int = 100
    think_time_s: float = 0.5  # mean of an exponential; 0 sends the next turn at once
    rate: float = 1.0  # new conversations per second (Poisson); 0 starts them all at once
    concurrency: int = 4  # conversations active at the same time
    session_header: bool = True  # send X-Session-ID
    model: str = "sim-model"
    seed: int = 0
    # think times drawn apart from the words, from this seed (None: from ``seed``, with the words): loads
    # with other words but one think seed pause alike, so modes compared side by side wait the same
    think_seed: int | None = None
    duration_s: float = 600.0  # no request starts after this
    max_requests: int = 100_000
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "concurrency", "max_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("system_tokens", "user_tokens", "think_time_s", "rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.answer_tokens < 1 or self.duration_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("answer_tokens, duration_s and request_timeout_s must be positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Words that are one token each (with their leading space) on the simulator's tokenizer."""
    from turnkv.sim.tokenizer import Tokenizer

    return tuple(Tokenizer().words)


def words(rng: random.Random, n: int, vocab: Sequence[str] | None = None) -> str:
    v = vocab or vocabulary()
    return "".join(" " + v[rng.randrange(len(v))] for _ in range(n))


class Conversation:
    """One synthetic conversation: its fixed texts, and the history as the server answered it.
    ``vocab``: the words to draw from (default: the simulator's); ``extra_body``: more request fields,
    which win over the workload's."""

    def __init__(
        self,
        index: int,
        spec: WorkloadSpec,
        *,
        vocab: Sequence[str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        self.index = index
        self.spec = spec
        self.vocab = tuple(vocab) if vocab else None
        self.extra_body = dict(extra_body or {})
        self.rng = random.Random(f"{spec.seed}:{index}")
        self.think_rng = self.rng if spec.think_seed is None else random.Random(f"{spec.think_seed}:{index}:think")
        self.session_id = f"bench-{spec.seed}-{index}"
        self.messages: list[dict[str, Any]] = []
        if spec.system_tokens:
            self.messages.append({"role": "system", "content": words(self.rng, spec.system_tokens, self.vocab)})

    @property
    def turn(self) -> int:
        """The 1-based index of the next user turn."""
        return 1 + sum(1 for m in self.messages if m["role"] == "assistant")

    def next_request(self) -> dict[str, Any]:
        """Adds the next user message and returns the request body (the whole history)."""
        self.messages.append({"role": "user", "content": words(self.rng, self.spec.user_tokens, self.vocab)})
        return {
            "model": self.spec.model,
            "messages": self.messages,
            "max_tokens": self.spec.answer_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }

    def answered(self, content: str, reasoning: str) -> None:
        """Appends the answer exactly as it was received."""
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning"] = reasoning
        self.messages.append(msg)

    def think_time(self) -> float:
        mean = self.spec.think_time_s
        return self.think_rng.expovariate(1.0 / mean) if mean > 0 else 0.0


def arrival_offsets(spec: WorkloadSpec) -> list[float]:
    """Seconds from the start at which each conversation arrives (a Poisson process at ``rate``)."""
    if spec.rate <= 0:
        return [0.0] * spec.conversations
    rng = random.Random(f"{spec.seed}:arrivals")
    t, out = 0.0, []
    for _ in range(spec.conversations):
        out.append(t)
        t += rng.expovariate(spec.rate)
    return out
