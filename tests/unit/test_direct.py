"""How big the new part of a turn is, estimated without rendering it (gateway/turn/direct.py)."""

from __future__ import annotations

from typing import Any

import pytest

from turnkv.gateway.turn.direct import new_tokens_estimate

SYS = {"role": "system", "content": "You are terse."}
ANSWER = {"role": "assistant", "content": "Sure."}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([SYS, {"role": "user", "content": "hi"}], None),  # nothing for D to continue
        ([SYS, {"role": "user", "content": "a"}, ANSWER], None),  # no new message
        ([SYS, {"role": "user", "content": "a"}, ANSWER, {"role": "user", "content": "x" * 300}], 100 + 8 * 3),
        # CJK: 3 bytes a character, about a token each
        ([SYS, {"role": "user", "content": "a"}, ANSWER, {"role": "user", "content": "旅" * 100}], 100 + 8 * 3),
        # tool results and multimodal text parts count too
        ([SYS, {"role": "user", "content": "a"}, ANSWER, {"role": "tool", "tool_call_id": "1", "content": "y" * 30},
          {"role": "user", "content": [{"type": "text", "text": "z" * 30}]}], 20 + 8 * 4),
        ([SYS, {"role": "user", "content": "a"}, ANSWER, "not a message"], None),
        ([SYS, {"role": "user", "content": "a"}, ANSWER, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}], None),
    ],
)
def test_new_tokens_estimate(messages: list[Any], expected: int | None) -> None:
    assert new_tokens_estimate(messages) == expected


def test_the_estimate_does_not_undercount_english() -> None:
    # ~4 bytes a token in English: 3 bytes a token overestimates, so the stall budget is kept
    text = "Please summarise the attached quarterly report for the board. " * 40
    assert new_tokens_estimate([SYS, ANSWER, {"role": "user", "content": text}]) > len(text) / 4
