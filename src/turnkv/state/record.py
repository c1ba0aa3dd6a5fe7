"""What turnkv remembers about a conversation between two turns, and how it is written down.

A record names the decode engine that holds the conversation's KV, the handle that engine
returned (opaque, verbatim) with its pin id (what the engine says tells that pin from any other:
``Engine.pin_id``, asked when CAPTURE built the record; the stores key the pin index by it and never
look inside a handle), the hash chain of the tokens those blocks hold, and what is needed to explain a
refusal later (where the last answer started, digests of its text). Records are single-use: a turn
claims one and stores the next.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, fields, replace
from typing import Any

from turnkv import jsonwire

FORMAT_VERSION = 3  # 2: explicit chaining, d[i] = H(d[i-1] + block i); 3: optional handle


@dataclass(frozen=True)
class ConversationRecord:
    tenant: str
    decode_url: str
    prefill_url: str | None
    handle: dict[str, Any] | None  # None: the record pins nothing on D (see ``unpinned``)
    engine_id: str
    engine_epoch: float | None  # the decode engine's process start time when the handle was made
    num_tokens: int  # tokens whose KV the handle's blocks hold (remote_num_tokens)
    chain: bytes  # one 8-byte digest per block of those tokens
    block_size: int
    prompt_tokens: int  # where the last answer started
    answer_digest: str  # digest of the last answer's content and tool calls, as streamed
    reasoning_digest: str | None  # digest of its reasoning; None when it had none
    turn: int
    created_at: float  # gateway wall clock
    expires_at: float  # gateway wall clock; past it the handle is not used
    # digest of the request this answer was for (its messages and whatever else shapes the prompt):
    # a next turn whose history before the answer has this digest continued the conversation as is
    history_digest: str | None = None
    bytes_per_token: float | None = None  # the conversation's text bytes per prompt token (turn/direct.py)
    # why the record holds no handle: released to keep D's memory within its budget ("budget"), under
    # memory pressure ("pressure") or while turns waited on D ("decode_crowded"), not worth its bytes
    # ("not_needed"), or never had one (a decode-local turn, "decode_local"; a stream without it,
    # "no_handle_in_stream"); D's blocks may still sit in its prefix cache, so decode-local can use them
    unpinned: str | None = None
    answer_calls: int = 0  # tool calls the last answer made (to tell a rewrite as text from an edit)
    # one digest of all ``num_tokens`` ids (``chain.sequence_digest``): proves a prompt starts with them in
    # one call, where the chain takes one per block; None in records written before it (the chain decides)
    tokens_digest: bytes | None = None
    # the handle's pin id (``Engine.pin_id``): what tells this pin from the conversation's next one; set with
    # the handle and only with it. Not in the JSON of a record stored without its handle (the Redis store
    # keeps handle and pin id beside the record)
    pin_id: str | None = None

    def __post_init__(self) -> None:
        if (self.handle is None) != (self.pin_id is None):
            raise ValueError("a record holds a handle together with its pin id, or neither")

    def unpin(self, why: str) -> ConversationRecord:
        """This record without its handle (D's blocks released or left to its prefix cache), saying why."""
        return replace(self, handle=None, pin_id=None, unpinned=why)

    def repin(self, handle: dict[str, Any], pin_id: str) -> ConversationRecord:
        """This record holding ``handle`` again (a write-back of it was dropped before it was sent)."""
        return replace(self, handle=handle, pin_id=pin_id, unpinned=None)

    @property
    def had_reasoning(self) -> bool:
        return self.reasoning_digest is not None

    def to_json(self) -> str:
        # the members as they are (not ``asdict``, which deep-copies the handle's lists to dump them once)
        d = {name: getattr(self, name) for name in _NAMES}
        d["chain"] = base64.b64encode(self.chain).decode()
        if self.tokens_digest is None:
            del d["tokens_digest"]  # as records without it were written
        else:
            d["tokens_digest"] = base64.b64encode(self.tokens_digest).decode()
        if self.pin_id is None:
            del d["pin_id"]
        d["v"] = FORMAT_VERSION
        return jsonwire.dumps(d).decode()

    @classmethod
    def from_json(cls, raw: str | bytes) -> ConversationRecord:
        d = jsonwire.loads_lenient(raw)
        if d.pop("v", None) != FORMAT_VERSION:
            raise ValueError("record written by another format version")
        d["chain"] = base64.b64decode(d["chain"])
        if d.get("tokens_digest") is not None:
            d["tokens_digest"] = base64.b64decode(d["tokens_digest"])
        # a member a later gateway added within this format version (one that only helps, as tokens_digest
        # did) is left out; a change that alters what a record means takes a new FORMAT_VERSION
        return cls(**{k: v for k, v in d.items() if k in _FIELDS})


_NAMES = tuple(f.name for f in fields(ConversationRecord))
_FIELDS = frozenset(_NAMES)
