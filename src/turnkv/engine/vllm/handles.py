"""vLLM's KV handles (``kv_transfer_params``, NixlConnector, ``bidirectional_kv_xfer``): their shapes.

What P is sent to prefill for remote decode (``P_ONLY``), how D's handle is cut to the tokens P may
pull, how it becomes a release inside a turn's prefill (``remote_num_tokens: 0``: P pulls nothing and
notifies D, which frees the blocks at once; verified on vLLM 0.26) or a release on its own
(``release_request``), and what a handle D returned must hold to be stored.

Why a release on its own takes the remote-prefill form: vLLM's P handles a request only once its
scheduler allocates it, and its FCFS queue stops at the first request it cannot allocate. Under load
P's KV fills with prefills leased to D, D's with pins, and a release in the proxy's form
(``do_remote_decode``) waits behind prefills that wait for D's room: aborted there, it frees nothing
(``request_finished`` stops tracking it), and D stays full until its TTL (the 64-conversation H200
run, BENCHMARKS.md section 6). A request that still carries ``do_remote_prefill`` when it is aborted
before allocation hands the worker an empty recv, which only notifies D (``pull_scheduler.py``
``request_finished``, 0.26 and 0.33), so the release frees D's blocks whether P runs it or the gateway
gives up on it in P's queue.
"""

from __future__ import annotations

from turnkv.engine.base import Handle, HandleFacts, HandleProblem, HandleUse

# a prefill for remote decode, with nothing to pull
P_ONLY: Handle = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_ADDRESS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def trim_handle(handle: Handle, tokens: int, block_size: int) -> Handle:
    """D's handle cut to its first ``tokens`` tokens, as P should pull it on the next turn."""
    blocks = -(-tokens // block_size)
    groups = handle.get("remote_block_ids") or []
    assert isinstance(groups, list)
    out = dict(handle)
    out["remote_block_ids"] = [list(g)[:blocks] for g in groups]
    out["remote_num_tokens"] = tokens
    out["do_remote_decode"] = True
    out["do_remote_prefill"] = False
    return out


def release_handle(handle: Handle) -> Handle:
    """D's handle with nothing to pull: P only notifies D, which frees the pinned blocks at once."""
    out = dict(handle)
    out["remote_num_tokens"] = 0
    out["do_remote_decode"] = True
    out["do_remote_prefill"] = False
    return out


def release_request(handle: Handle) -> Handle:
    """D's handle as a remote prefill of a one-token prompt on P: P reads at most D's last block into a
    block of its own and notifies D; aborted in P's queue before that, it notifies D all the same."""
    out = dict(handle)
    out["do_remote_prefill"] = True
    out["do_remote_decode"] = False
    return out


def write_back_request(handle: Handle, tokens: int, block_size: int) -> Handle:
    """D's handle, cut to its first ``tokens`` tokens, as a remote prefill on P of exactly those tokens: P
    pulls every block its own prefix cache lacks (D's list end-trimmed to P's blocks, which line up when
    P's prompt is the handle's first ``tokens`` tokens), caches them under the prompt's hashes, and its read
    tells D to free the request's blocks (``pull_scheduler.py`` get_num_new_matched_tokens,
    update_state_after_alloc; ``scheduler.py`` _update_waiting_for_remote_kv caches them; 0.26)."""
    out = trim_handle(handle, tokens, block_size)
    out["do_remote_prefill"] = True
    out["do_remote_decode"] = False
    return out


def prefill_params(use: HandleUse | None, block_size: int) -> Handle:
    """What P gets as its ``kv_transfer_params``: the stored handle trimmed to what it may pull, or
    turned into a release, or nothing to pull at all."""
    if use is None:
        return dict(P_ONLY)
    return trim_handle(use.handle, use.tokens, block_size) if use.tokens > 0 else release_handle(use.handle)


def read_handle(h: Handle, *, seq_len: int, block_size: int) -> HandleFacts | HandleProblem:
    """What D's handle holds, or why it cannot be stored (it must cover at most the sequence D computed,
    within its blocks, and say where the blocks are)."""
    groups = h.get("remote_block_ids")
    n = h.get("remote_num_tokens")
    if not h.get("do_remote_decode") or not isinstance(groups, list) or not groups or not isinstance(n, int):
        return HandleProblem.NOT_A_DECODE_HANDLE
    if n <= 0 or n > seq_len or any(len(g) * block_size < n for g in groups if isinstance(g, list)):
        return HandleProblem.INCONSISTENT
    if not all(h.get(k) is not None for k in _ADDRESS):
        return HandleProblem.INCOMPLETE
    return HandleFacts(tokens=n, engine_id=str(h["remote_engine_id"]))


def pin_id(h: Handle) -> str:
    """D's request id: what tells this pin from the conversation's next one."""
    return str(h.get("remote_request_id"))


def pins_memory(h: Handle) -> bool:
    """A handle for remote decode pins its blocks on D until pulled, released or past its TTL."""
    return bool(h.get("do_remote_decode"))
