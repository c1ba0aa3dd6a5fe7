"""What finding a conversation from its messages costs per turn: ``conversation_of`` (the history
digest, ``gateway/identity.py``) on agent histories of about 2k, 16k and 32k tokens.

    .venv/bin/python scripts/history_digest.py

Histories are tool-using agent conversations (system prompt, user turns, assistant answers with
reasoning, tool calls and tool results) of English-like text at ~4 bytes per token. For scale, the
JSON parse of the same request body (which every request pays already) is measured beside it.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

from turnkv.gateway.identity import conversation_of

WORDS = (
    "the museum opens at nine and the station is ten minutes away by tram so plan the morning there "
    "then walk along the river to the old town where dinner costs about thirty euros"
).split()
OPTS: dict[str, Any] = {"session_headers": ["x-session-id"], "tenant": "bench", "max_length": 256}


def text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens * 0.8)))  # ~1.25 tokens per word


def history(tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 600)}]
    i = 0
    while sum(len(json.dumps(m)) for m in msgs) / 4 < tokens:
        i += 1
        msgs.append({"role": "user", "content": text(rng, 60)})
        msgs.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning": text(rng, 120),
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"topic": text(rng, 4), "limit": i})},
                    }
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": text(rng, 250)})
        msgs.append({"role": "assistant", "content": text(rng, 150), "reasoning": text(rng, 80)})
    return msgs


def median_ms(fn: Any, runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def measure(tokens: int, runs: int) -> tuple[int, float, float, float]:
    """Messages, body KB, the digest's and the body parse's median ms for a history of ``tokens``."""
    msgs = history(tokens)
    body = {"model": "m", "messages": msgs}
    raw = json.dumps(body)
    digest = median_ms(lambda: conversation_of({}, body, **OPTS), runs)
    parse = median_ms(lambda: json.loads(raw), runs)
    return len(msgs), len(raw) / 1024, digest, parse


def main(runs: int = 200) -> None:
    print(f"{'history':>8} {'messages':>8} {'body KB':>8} {'digest ms':>10} {'json.loads ms':>14}")
    for tokens in (2_000, 16_000, 32_000):
        n, kb, digest, parse = measure(tokens, runs)
        print(f"{tokens // 1000:>7}k {n:>8} {kb:>8.0f} {digest:>10.3f} {parse:>14.3f}")


if __name__ == "__main__":
    main()
