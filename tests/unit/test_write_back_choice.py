"""After a turn: write D's KV back to P, keep it pinned, or let it go (``reuse.writeback``), as a table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from turnkv.reuse.decision import Keep
from turnkv.reuse.writeback import After, AfterChoice, AfterFacts, AfterParams, Why, after_turn

BASE = AfterFacts(
    keep=Keep.PULL,
    decode_pressed=False,
    has_prefill=True,
    prefill_kv_usage=0.4,
    prefill_cache_factor=1.0,
    transfer_s=0.05,
    think_s=0.5,
)
WB, KEEP, GO = AfterChoice.WRITE_BACK, AfterChoice.KEEP, AfterChoice.LET_GO


@pytest.mark.parametrize(
    ("change", "params", "want"),
    [
        ({}, {}, After(WB)),  # P has room and keeps what it gets, the user thinks longer than the transfer
        ({"keep": Keep.HEDGE}, {}, After(WB)),
        ({"think_s": None}, {}, After(KEEP, Why.THINK_UNKNOWN)),  # not measured yet: as before write-back
        # D would take the next turn from its own cache: nothing to keep, nothing to write back
        ({"keep": Keep.NOT_NEEDED}, {}, After(GO, Why.NOT_KEPT)),
        # an agent's tool loop: the next call comes before the write-back would be done; a pull stays ready
        ({"think_s": 0.01}, {}, After(KEEP, Why.THINK_TOO_SHORT)),
        ({"prefill_kv_usage": 0.9}, {}, After(KEEP, Why.PREFILL_FULL)),
        ({"prefill_cache_factor": 0.2}, {}, After(KEEP, Why.PREFILL_EVICTS)),
        ({"has_prefill": False}, {}, After(KEEP, Why.NO_PREFILL)),
        # D short of KV or queued: nothing stays pinned; written back where P takes it, whatever the think time
        ({"decode_pressed": True, "think_s": 0.01}, {}, After(WB)),
        ({"decode_pressed": True, "think_s": None}, {}, After(WB)),
        ({"decode_pressed": True, "keep": Keep.NOT_NEEDED}, {}, After(WB)),
        ({"decode_pressed": True, "prefill_kv_usage": 0.95}, {}, After(GO, Why.PREFILL_FULL)),
        # always: every handle is written back where P has room
        ({"think_s": 0.01, "prefill_cache_factor": 0.0}, {"mode": "always"}, After(WB)),
        ({"keep": Keep.NOT_NEEDED, "think_s": None}, {"mode": "always"}, After(WB)),
        ({"prefill_kv_usage": 0.9}, {"mode": "always"}, After(KEEP, Why.PREFILL_FULL)),
        # off: as before write-back
        ({}, {"mode": "off"}, After(KEEP, Why.OFF)),
        ({"decode_pressed": True}, {"mode": "off"}, After(GO, Why.OFF)),
        ({"keep": Keep.NOT_NEEDED}, {"mode": "off"}, After(GO, Why.OFF)),
    ],
)
def test_after_turn(change: dict[str, object], params: dict[str, object], want: After) -> None:
    assert after_turn(replace(BASE, **change), AfterParams(**params)) == want  # type: ignore[arg-type]
