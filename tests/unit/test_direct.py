"""How big the new part of a turn is, estimated without rendering it (gateway/turn/direct.py)."""

from __future__ import annotations

from typing import Any

import pytest

from turnkv.gateway.turn.direct import bytes_per_token, continuation, history_digest

SYS = {"role": "system", "content": "You are terse."}
ANSWER = {"role": "assistant", "content": "Sure."}


def new_tokens_estimate(messages: list[Any], measured_bytes_per_token: float | None = None) -> int | None:
    c = continuation(messages)
    return None if c is None else c.new_tokens(measured_bytes_per_token)


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([SYS, {"role": "user", "content": "hi"}], None),  # nothing for D to continue
        ([SYS, {"role": "user", "content": "a"}, ANSWER], None),  # no new message
        ([SYS, {"role": "user", "content": "a"}, ANSWER, {"role": "user", "content": "x" * 300}], 120 + 8 * 3),
        # CJK: 3 bytes a character, about a token each
        ([SYS, {"role": "user", "content": "a"}, ANSWER, {"role": "user", "content": "旅" * 100}], 120 + 8 * 3),
        # every digit is a token
        ([SYS, {"role": "user", "content": "a"}, ANSWER, {"role": "user", "content": "1234567890" * 10}], 100 + 8 * 3),
        # tool results and multimodal text parts count too
        (
            [
                SYS,
                {"role": "user", "content": "a"},
                ANSWER,
                {"role": "tool", "tool_call_id": "1", "content": "y" * 30},
                {"role": "user", "content": [{"type": "text", "text": "z" * 30}]},
            ],
            24 + 8 * 4,
        ),
        ([SYS, {"role": "user", "content": "a"}, ANSWER, "not a message"], None),
        (
            [
                SYS,
                {"role": "user", "content": "a"},
                ANSWER,
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
            ],
            None,
        ),
    ],
)
def test_new_tokens_estimate(messages: list[Any], expected: int | None) -> None:
    assert new_tokens_estimate(messages) == expected


def test_the_estimate_does_not_undercount_english() -> None:
    # ~4 bytes a token in English: 3 bytes a token overestimates, so the stall budget is kept
    text = "Please summarise the attached quarterly report for the board. " * 40
    estimate = new_tokens_estimate([SYS, ANSWER, {"role": "user", "content": text}])
    assert estimate is not None and estimate > len(text) / 4


def test_history_digest_sees_what_changes_the_prompt() -> None:
    first = [SYS, {"role": "user", "content": "a"}]
    body = {"model": "m", "messages": first, "temperature": 0.2}
    recorded = history_digest(body, first)
    nxt = [*first, ANSWER, {"role": "user", "content": "b"}]
    # the next request's history before the answer: the same, whatever its sampling parameters
    assert history_digest({"model": "m", "messages": nxt, "temperature": 1.0}, nxt[:2]) == recorded
    # a compacted history, new tools, or other template options: different
    assert history_digest({"model": "m"}, [{"role": "user", "content": "a"}]) != recorded
    assert history_digest({"model": "m", "tools": [{"type": "function"}]}, nxt[:2]) != recorded
    assert history_digest({"model": "m", "chat_template_kwargs": {"enable_thinking": False}}, nxt[:2]) != recorded


def test_the_conversation_measures_its_own_bytes_per_token() -> None:
    history = [SYS, {"role": "user", "content": "x" * 986 + "12345678"}]  # 1000 other bytes with SYS, 8 digits
    assert bytes_per_token(history, 8 + 250) == 4.0  # 1000 other bytes over 250 other tokens
    assert bytes_per_token(history, 5) is None  # fewer tokens than digits: not a measurement
    assert bytes_per_token([{"role": "user", "content": [{"type": "image_url"}]}], 100) is None
    turn = [SYS, {"role": "user", "content": "a"}, ANSWER, {"role": "user", "content": "y" * 1000}]
    # 4 bytes a token measured, used with a 25% margin: 1000 / 3.2 tokens, against 1000 / 2.5 unmeasured
    assert new_tokens_estimate(turn, 4.0) == 313 + 8 * 3
    assert new_tokens_estimate(turn) == 400 + 8 * 3
