"""What gpu/load.py needs from the load generator: the caller's words and request fields in every
turn, distinct texts per conversation and per seed, and the records of a run it cancels."""

from __future__ import annotations

import asyncio

import pytest

from turnkv import launch
from turnkv.bench.client import Target
from turnkv.bench.records import RequestRecord
from turnkv.bench.runner import run_load
from turnkv.bench.workload import Conversation, WorkloadSpec, vocabulary

VOCAB = ("alpha", "bravo", "charlie", "delta")


class _Noticed(list[RequestRecord]):
    """A record list that says when its first record arrives."""

    first: asyncio.Event

    def append(self, r: RequestRecord) -> None:
        super().append(r)
        self.first.set()


def _words(conv: Conversation) -> set[str]:
    """The words the client wrote (system and user messages; answers are the engine's)."""
    return {w for m in conv.messages if m["role"] != "assistant" for w in m["content"].split()}


def test_a_conversation_draws_only_the_given_words_and_sends_the_extra_fields() -> None:
    spec = WorkloadSpec(system_tokens=300, user_tokens=40, answer_tokens=7)
    conv = Conversation(0, spec, vocab=VOCAB, extra_body={"allowed_token_ids": [5, 6], "max_tokens": 3})
    body = conv.next_request()
    assert _words(conv) <= set(VOCAB) and len(_words(conv)) == len(VOCAB)
    assert len(body["messages"][0]["content"].split()) == 300
    assert body["allowed_token_ids"] == [5, 6]
    assert body["max_tokens"] == 3  # the caller's fields win over the workload's
    conv.answered("bravo delta", "")
    assert "allowed_token_ids" in conv.next_request()  # every turn, not only the first
    plain = Conversation(0, spec)
    plain.next_request()
    assert not _words(plain) <= set(VOCAB) and _words(plain) <= set(vocabulary())
    assert "allowed_token_ids" not in plain.next_request()


def test_system_prompts_differ_per_conversation_and_per_seed() -> None:
    spec = WorkloadSpec(system_tokens=200)
    other = WorkloadSpec(system_tokens=200, seed=1)
    texts = [Conversation(i, s).messages[0]["content"] for s in (spec, other) for i in range(8)]
    assert len(set(texts)) == 16
    assert len({Conversation(i, s).session_id for s in (spec, other) for i in range(8)}) == 16
    assert Conversation(3, spec).messages == Conversation(3, spec).messages  # reproducible


@pytest.mark.integration
def test_a_cancelled_run_keeps_the_records_of_finished_requests(procs: list[launch.Running]) -> None:
    # decode slow enough that the run is still going when its first request has finished
    sim = launch.sim("colo", "colocated", "--time-scale", "1", "--decode-itl-ms", "20")
    procs.append(sim)
    spec = WorkloadSpec(
        conversations=4,
        concurrency=4,
        turns=4,
        system_tokens=100,
        user_tokens=10,
        answer_tokens=20,
        think_time_s=0,
        rate=0,
        request_timeout_s=60,
    )
    made: list[Conversation] = []

    def conversation(index: int, s: WorkloadSpec) -> Conversation:
        made.append(Conversation(index, s, vocab=VOCAB))
        return made[-1]

    records = _Noticed()

    async def main() -> None:
        records.first = asyncio.Event()
        run = asyncio.create_task(
            run_load(spec, Target(url=sim.url), show_progress=False, conversation=conversation, records=records)
        )
        await asyncio.wait_for(records.first.wait(), 30)
        assert not run.done(), "the run ended before it could be cancelled"
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(main())
    assert records and len(records) < spec.conversations * spec.turns
    assert all(r.ok and r.ttft_ms is not None for r in records)
    assert len(made) == spec.conversations
    assert all(_words(c) <= set(VOCAB) for c in made)
    sent = sum(1 for c in made for m in c.messages if m["role"] == "user")
    assert sent > len(records)  # the requests in flight at the cancel are not recorded
