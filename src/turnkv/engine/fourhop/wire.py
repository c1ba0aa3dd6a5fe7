"""What the four hops send: render's ``GenerateRequest`` made into P's, D's and a release's generate bodies.

A tokens-only engine reads KV transfer params on ``/inference/v1/generate`` only inside
``sampling_params.extra_args.kv_transfer_params`` up to vLLM 0.28, and at the top level (which wins) from
0.29; ``Placement`` says where, from the version the engine reports, and puts them in both places while it
has not said (a version reads the one it knows; the other is ignored there, or the same dict).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from turnkv.engine.base import Handle

TOP_LEVEL_FROM = (0, 29)
# what render's answer carries that is the render service's business, not an engine's
_RENDER_ONLY = ("assistant_tokens_mask", "token_offsets", "features", "content_parts", "reasoning_parser_kwargs")


class Placement(enum.StrEnum):
    EXTRA_ARGS = "extra_args"  # vLLM 0.26-0.28
    TOP_LEVEL = "top_level"  # 0.29+
    BOTH = "both"  # the engine has not said its version


def placement_of(version: tuple[int, ...] | None) -> Placement:
    if not version:
        return Placement.BOTH
    return Placement.TOP_LEVEL if version[:2] >= TOP_LEVEL_FROM else Placement.EXTRA_ARGS


def with_params(body: dict[str, Any], params: Handle | None, placement: Placement) -> dict[str, Any]:
    """``body`` carrying ``params`` where an engine of ``placement`` reads them (None: none anywhere)."""
    sp = dict(body.get("sampling_params") or {})
    extra = dict(sp.get("extra_args") or {})
    extra.pop("kv_transfer_params", None)
    body.pop("kv_transfer_params", None)
    if params is not None and placement is not Placement.TOP_LEVEL:
        extra["kv_transfer_params"] = params
    if params is not None and placement is not Placement.EXTRA_ARGS:
        body["kv_transfer_params"] = params
    if extra:
        sp["extra_args"] = extra
    else:
        sp.pop("extra_args", None)
    body["sampling_params"] = sp
    return body


def generate_body(
    rendered: Mapping[str, Any], *, stream: bool, max_tokens: int | None, request_id: str | None
) -> dict[str, Any]:
    """A generate request from render's answer: its ids and sampling parameters as render wrote them, streamed or
    not. ``max_tokens`` is set explicitly (render leaves a client's 16 out as SamplingParams' default, and a
    tokens-only engine then generates to the model's length)."""
    body = {k: copy.deepcopy(v) for k, v in rendered.items() if k not in _RENDER_ONLY}
    sp = dict(body.get("sampling_params") or {})
    if max_tokens is not None:
        sp["max_tokens"] = max_tokens
    sp["output_kind"] = 1 if stream else 2  # DELTA, FINAL_ONLY (0.26 keeps render's for a body not streamed)
    body["sampling_params"] = sp
    body["stream"] = stream
    body["stream_options"] = {"include_usage": True} if stream else None
    if request_id is not None:
        body["request_id"] = request_id
    return body


def prefill_body(
    rendered: Mapping[str, Any], params: Handle, placement: Placement, request_id: str | None
) -> dict[str, Any]:
    """P's generate: the prompt to one token, for remote decode (with D's handle to pull, or a release)."""
    body = generate_body(rendered, stream=False, max_tokens=1, request_id=request_id)
    sp = body["sampling_params"]
    sp.pop("min_tokens", None)  # P samples one token only
    return with_params(body, params, placement)


def decode_body(
    rendered: Mapping[str, Any],
    for_decode: Handle | None,
    placement: Placement,
    *,
    stream: bool,
    max_tokens: int | None,
    request_id: str | None,
) -> dict[str, Any]:
    """D's generate: the client's sampling, continued from P's KV (or computed by D itself: no params at all,
    as vLLM pins untracked blocks of a request whose params set neither direction)."""
    body = generate_body(rendered, stream=stream, max_tokens=max_tokens, request_id=request_id)
    return with_params(body, dict(for_decode) if for_decode else None, placement)


def tokens_body(
    ids: Sequence[int], params: Handle, placement: Placement, *, max_tokens: int, model: str | None
) -> dict[str, Any]:
    """A generate of bare ids (a release, a write-back): streamed, to be closed at its first output."""
    body: dict[str, Any] = {
        "token_ids": list(ids),
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
        "stream": True,
    }
    if model:
        body["model"] = model
    return with_params(body, params, placement)
