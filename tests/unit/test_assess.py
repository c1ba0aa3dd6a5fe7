"""The token check: what may be reused, and the reason code when not everything may."""

from __future__ import annotations

import dataclasses

import pytest

from turnkv.engine.vllm.handles import release_handle, trim_handle
from turnkv.openai.answer import EchoedAnswer
from turnkv.reuse.assess import (
    EngineView,
    Reason,
    TemplateClass,
    assess,
)
from turnkv.reuse.chain import chain_of, proves, sequence_digest
from turnkv.state.base import Claim, ClaimStatus
from turnkv.state.record import ConversationRecord

BS = 4
PROMPT = list(range(1, 11))  # the previous turn's prompt: 10 tokens
ANSWER = [50, 51, 52, 53, 54, 55, 2]  # generated; the last one (EOS) has no KV
SEQ = PROMPT + ANSWER
N = len(SEQ) - 1  # remote_num_tokens
HANDLE = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[7, 8, 9, 10, 11]],
    "remote_engine_id": "e1",
    "remote_request_id": "r1",
    "remote_host": "h",
    "remote_port": 1,
    "tp_size": 1,
    "remote_num_tokens": N,
    "remote_blocks_expiry_time": 123.0,
}
REC = ConversationRecord(
    tenant="t",
    decode_url="http://d",
    prefill_url="http://p",
    handle=HANDLE,
    engine_id="e1",
    engine_epoch=1.0,
    num_tokens=N,
    chain=chain_of(SEQ[:N], BS),
    block_size=BS,
    prompt_tokens=len(PROMPT),
    answer_digest="A",
    reasoning_digest="R",
    turn=1,
    created_at=0.0,
    expires_at=100.0,
    pin_id="r1",
)
NEXT = SEQ + [70, 71, 72]  # the next turn's prompt, extending D's sequence
SAME = EchoedAnswer("A", True, "R")
UP = EngineView(True, 1.0)


FOUND = Claim(ClaimStatus.FOUND, REC)


def run(
    claim: Claim = FOUND,
    prompt: list[int] = NEXT,
    *,
    tenant: str = "t",
    now: float = 50.0,
    decode: EngineView | None = UP,
    echoed: EchoedAnswer | None = SAME,
    template: TemplateClass = TemplateClass.PRESERVES,
) -> tuple[int, bool, Reason, bool]:
    a = assess(claim, prompt, tenant=tenant, now=now, decode=decode, echoed=echoed, template=template, block_size=BS)
    return a.tokens, a.full, a.reason, a.releasable


STRIPPED = PROMPT + [60, 61, 62, 63, 64, 65, 66, 67]  # the answer re-rendered without its reasoning


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, (N, True, Reason.FULL_MATCH, True)),
        ({"claim": Claim(ClaimStatus.MISSING)}, (0, False, Reason.NO_RECORD, False)),
        ({"claim": Claim(ClaimStatus.IN_FLIGHT)}, (0, False, Reason.CONCURRENT_TURN, False)),
        ({"claim": Claim(ClaimStatus.CORRUPT)}, (0, False, Reason.CORRUPT_RECORD, False)),
        ({"tenant": "other"}, (0, False, Reason.TENANT, False)),
        ({"now": 100.0}, (0, False, Reason.EXPIRED, False)),
        ({"decode": EngineView(False, 1.0)}, (0, False, Reason.DECODE_UNAVAILABLE, False)),
        ({"decode": None}, (0, False, Reason.DECODE_UNAVAILABLE, False)),
        ({"decode": EngineView(True, 2.0)}, (0, False, Reason.ENGINE_RESTARTED, False)),
        ({"decode": EngineView(True, None)}, (N, True, Reason.FULL_MATCH, True)),
        # the answer's reasoning is gone: two blocks of the old prompt still agree
        # the client sent it back without (LangChain, smolagents): not the template's doing
        ({"prompt": STRIPPED, "echoed": EchoedAnswer("A", False, None)}, (8, False, Reason.REASONING_DROPPED, True)),
        ({"prompt": STRIPPED, "template": TemplateClass.DROPS_REASONING}, (8, False, Reason.REASONING_STRIPPED, True)),
        ({"prompt": STRIPPED, "echoed": EchoedAnswer("B", True, "R")}, (8, False, Reason.ANSWER_EDITED, True)),
        # an answer that called a tool, sent back as text (smolagents)
        (
            {
                "prompt": STRIPPED,
                "echoed": EchoedAnswer("B", True, "R"),
                "claim": Claim(ClaimStatus.FOUND, dataclasses.replace(REC, answer_calls=1)),
            },
            (8, False, Reason.ANSWER_AS_TEXT, True),
        ),
        ({"prompt": STRIPPED, "echoed": EchoedAnswer("A", True, "X")}, (8, False, Reason.ANSWER_EDITED, True)),
        ({"prompt": STRIPPED}, (8, False, Reason.RETOKENIZED, True)),
        ({"prompt": STRIPPED, "template": TemplateClass.REWRITES_HISTORY}, (8, False, Reason.HISTORY_EDITED, True)),
        ({"prompt": STRIPPED, "echoed": None}, (8, False, Reason.HISTORY_EDITED, True)),
        ({"prompt": [9, *NEXT[1:]]}, (0, False, Reason.HISTORY_EDITED, True)),
        ({"prompt": SEQ[:9]}, (8, False, Reason.PROMPT_SHORTER, True)),
    ],
)
def test_assess(kwargs: dict[str, object], expected: tuple[int, bool, Reason, bool]) -> None:
    assert run(**kwargs) == expected  # type: ignore[arg-type]


def test_a_record_of_another_block_size_is_not_compared() -> None:
    rec = dataclasses.replace(REC, block_size=8)
    assert run(Claim(ClaimStatus.FOUND, rec))[2] is Reason.BLOCK_SIZE_CHANGED


def test_trim_keeps_the_first_blocks_and_marks_it_for_p() -> None:
    h = trim_handle(HANDLE, 8, BS)
    assert h["remote_block_ids"] == [[7, 8]]
    assert h["remote_num_tokens"] == 8
    assert (h["do_remote_decode"], h["do_remote_prefill"]) == (True, False)
    assert h["remote_blocks_expiry_time"] == 123.0
    assert HANDLE["remote_block_ids"] == [[7, 8, 9, 10, 11]]  # the original is untouched


def test_a_partial_last_block_is_kept() -> None:
    h = trim_handle(HANDLE, 13, BS)
    assert h["remote_block_ids"] == [[7, 8, 9, 10]]  # 13 tokens: three full blocks and one partial
    assert h["remote_num_tokens"] == 13


def test_release_pulls_nothing() -> None:
    h = release_handle(HANDLE)
    assert h["remote_num_tokens"] == 0
    assert h["remote_block_ids"] == HANDLE["remote_block_ids"]
    assert (h["do_remote_decode"], h["do_remote_prefill"]) == (True, False)


@pytest.mark.parametrize(
    "prompt", [NEXT, SEQ[:N], SEQ[: N + 1], STRIPPED, [9, *NEXT[1:]], SEQ[:9], [*SEQ[: N - 1], 0, 1, 2]]
)
def test_a_proof_by_the_records_digest_assesses_as_the_chain_does(prompt: list[int]) -> None:
    rec = dataclasses.replace(REC, tokens_digest=sequence_digest(SEQ[:N]))
    claim = Claim(ClaimStatus.FOUND, rec)
    by_chain = assess(
        claim, prompt, tenant="t", now=50.0, decode=UP, echoed=SAME, template=TemplateClass.PRESERVES, block_size=BS
    )
    proved = proves(rec.tokens_digest, rec.num_tokens, prompt)
    assert proved is (prompt[:N] == SEQ[:N])
    by_digest = assess(
        claim,
        prompt,
        tenant="t",
        now=50.0,
        decode=UP,
        echoed=SAME,
        template=TemplateClass.PRESERVES,
        block_size=BS,
        proved=proved,
    )
    assert by_digest == by_chain
