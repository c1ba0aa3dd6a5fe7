"""PREFILL: run the prompt on a prefill engine with ``max_tokens: 1`` and get its handle for D.

With token ids from RENDER, P gets exactly those ids (``/v1/completions``); otherwise the client's
messages, changed as vLLM's P/D proxy changes them. A failed pull (P answers 5xx: expired handle,
restarted D, broken link), or one that stalls past the first-token deadline, is retried once on the
same P without the handle; an unreachable or failing P is replaced by the next healthy one (a single
P whose connection failed is tried once more).
Transition: PREFILL → DECODE.
"""

from __future__ import annotations

import time
from typing import Any

from turnkv.errors import UpstreamError, UpstreamStatus, UpstreamTimeout, UpstreamUnavailable
from turnkv.gateway.turn.context import Deadline, TurnContext, TurnState, until_aborted
from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import Action

P_ONLY = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
          "remote_block_ids": None, "remote_host": None, "remote_port": None}
_NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params",
                    "return_token_ids", "n", "logprobs", "top_logprobs")


def prefill_body(ctx: TurnContext, handle: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    params = dict(handle) if handle else dict(P_ONLY)
    if ctx.prompt_ids is not None:
        body: dict[str, Any] = {"model": ctx.body.get("model"), "prompt": ctx.prompt_ids, "max_tokens": 1,
                                "stream": False, "kv_transfer_params": params}
        if ctx.body.get("cache_salt") is not None:
            body["cache_salt"] = ctx.body["cache_salt"]
        return "/v1/completions", {k: v for k, v in body.items() if v is not None}
    body = {k: v for k, v in ctx.body.items() if k not in _NOT_FOR_PREFILL}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = params
    return ctx.path, body


async def run(ctx: TurnContext) -> TurnState:
    svc = ctx.svc
    handle = ctx.handle_for_prefill
    tried: set[str] = set()
    url = ctx.prefill_url
    only_one = len(svc.registry.role("prefill")) == 1
    attempts = len(svc.registry.role("prefill")) + 2
    last: UpstreamError | None = None
    retried_same = False
    for _ in range(attempts):
        inst = svc.registry.get(url) if url and url not in tried else svc.registry.pick(
            "prefill", exclude=frozenset(tried))
        if inst is None:
            break
        path, body = prefill_body(ctx, handle)
        t0 = time.perf_counter()
        ctx.handle_spent = ctx.handle_spent or handle is not None
        try:
            t = svc.settings.timeouts
            with svc.registry.busy(inst):
                call = svc.upstream.post_json("prefill", inst.url, path, body, ctx.headers())
                data = await until_aborted(ctx, call, Deadline("prefill", inst.url, t.prefill_first_token_s,
                                                               t.prefill_s))
        except UpstreamError as exc:
            last = exc
            if isinstance(exc, UpstreamTimeout):
                svc.metrics.deadline_misses.labels("prefill").inc()
                svc.registry.missed_deadline(inst.url)
            ctx.failed("prefill", inst.url, exc)
            if handle is not None and isinstance(exc, (UpstreamStatus, UpstreamTimeout)):
                # P failed or stalled on D's handle (expired, D restarted or full, link failure): again,
                # on the same P, without it
                timed_out = isinstance(exc, UpstreamTimeout)
                ctx.retrying("prefill", "first_token_deadline" if timed_out else "pull_failed")
                if ctx.action is Action.PULL:
                    ctx.reason = Reason.FIRST_TOKEN_DEADLINE if timed_out else Reason.PULL_FAILED
                    ctx.action = Action.RECOMPUTE
                handle, ctx.pull_tokens, ctx.expected_cached = None, 0, 0
                url = inst.url
                continue
            ctx.retrying("prefill", exc.kind)
            if only_one and isinstance(exc, UpstreamUnavailable) and not retried_same:
                retried_same, url = True, inst.url  # a single P's connection failed: once more, the same
                continue
            tried.add(inst.url)
            url = None
            continue
        svc.registry.met_deadline(inst.url)
        ctx.prefill_s = time.perf_counter() - t0
        ctx.prefill_url = inst.url
        ctx.prefill_params = data.get("kv_transfer_params") if isinstance(data.get("kv_transfer_params"),
                                                                          dict) else None
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        if isinstance(details.get("cached_tokens"), int):
            ctx.prefill_cached = details["cached_tokens"]
        ctx.prefill_prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
        _observe(ctx)
        return TurnState.DECODE
    raise last or UpstreamUnavailable("no prefill engine is available", leg="prefill")


def _observe(ctx: TurnContext) -> None:
    svc = ctx.svc
    svc.metrics.prefill_seconds.labels(ctx.action.value).observe(ctx.prefill_s)
    if ctx.prompt_ids is not None:
        n = len(ctx.prompt_ids)
    elif ctx.conversation is not None and isinstance(ctx.prefill_prompt_tokens, int):
        n = ctx.prefill_prompt_tokens  # a first turn sent as messages: P's usage says how long it was
    else:
        return
    cached = ctx.prefill_cached if ctx.prefill_cached is not None else ctx.expected_cached
    svc.estimator.observe_prefill(new_tokens=n - cached, context_tokens=cached, pulled_tokens=ctx.pull_tokens,
                                  seconds=ctx.prefill_s, block_size=svc.settings.block_size)
