"""What a turn tells the outside, computed from its results: the response's decision headers, and at its
end one ``turn`` log event and its metrics.

Clients, the benchmark and the dashboard read these: header names and log fields are kept as they are
(tests/pipeline/test_capture.py pins them).
"""

from __future__ import annotations

from turnkv.gateway.metrics import turn_bucket
from turnkv.gateway.turn.results import Capture
from turnkv.gateway.turn.run import TurnRun

# every decision header a turn's answer can carry (``headers``)
HEADERS = (
    "x-turnkv-outcome",
    "x-turnkv-action",
    "x-turnkv-reason",
    "x-turnkv-direct",
    "x-turnkv-ahead",
    "x-turnkv-divergence",
    "x-turnkv-matched-tokens",
    "x-turnkv-prompt-tokens",
    "x-turnkv-planned-pull-tokens",
    "x-turnkv-prefill-cached-tokens",
    "x-turnkv-prefill-ms",
)


def headers(run: TurnRun) -> dict[str, str]:
    """The turn's decision, for clients and benchmarks that want to see it. Token counts and prefill time
    tell a client about the engines' caches (docs/security.md): only with decision_headers full."""
    plan, prefilled = run.plan, run.prefilled
    h = {
        "x-request-id": run.turn.request_id,
        "x-turnkv-outcome": plan.outcome(run.stateful),
        "x-turnkv-action": plan.action.value,
        "x-turnkv-reason": plan.reason.value,
    }
    if plan.direct:
        h["x-turnkv-direct"] = "true"  # decode-local without a render call (turn/direct.py)
    if plan.ahead is not None:
        h["x-turnkv-ahead"] = plan.ahead.value  # sent to P before its render returned (turn/ahead.py)
    divergence = _divergence(run)
    if divergence is not None:
        h["x-turnkv-divergence"] = divergence  # why D's KV did not match, whatever the turn then did
    if run.svc.settings.decision_headers != "full":
        return h
    if plan.assessment is not None:
        h["x-turnkv-matched-tokens"] = str(plan.assessment.tokens)
    prompt_ids = run.rendered.prompt_ids
    if prompt_ids is not None:
        h["x-turnkv-prompt-tokens"] = str(len(prompt_ids))
    elif prefilled is not None and prefilled.result.prompt_tokens is not None:
        h["x-turnkv-prompt-tokens"] = str(prefilled.result.prompt_tokens)  # not rendered: P's count
    # the plan's figure: vLLM reports no per-request count of pulled tokens, only cached_tokens
    # (its prefix-cache hits and the pull together: x-turnkv-prefill-cached-tokens)
    h["x-turnkv-planned-pull-tokens"] = str(plan.pull_tokens)
    if prefilled is not None and prefilled.result.cached_tokens is not None:
        h["x-turnkv-prefill-cached-tokens"] = str(prefilled.result.cached_tokens)
    if run.prefill_url is not None and not plan.decode_local:
        h["x-turnkv-prefill-ms"] = f"{(prefilled.seconds if prefilled else 0.0) * 1e3:.1f}"
    return h


def _divergence(run: TurnRun) -> str | None:
    """Why the prompt left D's sequence, when the token check found it did and the reason the turn gives
    says something else (a decode-local or recomputed turn names the action's reason)."""
    a = run.plan.assessment
    if a is None or a.full or a.record is None or a.reason is run.plan.reason:
        return None
    return a.reason.value


def account(run: TurnRun, capture: Capture) -> None:
    """The turn's metrics and its one log event."""
    svc, turn, plan, prefilled = run.svc, run.turn, run.plan, run.prefilled
    m = svc.metrics
    outcome = plan.outcome(run.stateful)
    collected = run.collected
    m.decisions.labels(outcome, plan.action.value, plan.reason.value).inc()
    prompt_ids, seen = run.rendered.prompt_ids, collected.prompt_token_ids
    n_prompt = len(prompt_ids) if prompt_ids is not None else (len(seen) if seen else 0)
    p_cached = prefilled.result.cached_tokens if prefilled is not None else None
    cached = p_cached if p_cached is not None else plan.expected_cached
    computed = max(n_prompt - cached, 0)
    generated = len(collected.token_ids)
    m.tokens.labels("prompt").inc(n_prompt)
    m.tokens.labels("planned_pull").inc(plan.pull_tokens)
    m.tokens.labels("computed").inc(computed)
    m.tokens.labels("generated").inc(generated)
    ttft_ms = None
    first = run.journal.first_token_at
    if first is not None:
        ttft = first - turn.started
        ttft_ms = round(ttft * 1e3, 2)
        m.ttft.labels(turn_bucket(turn.index), outcome).observe(ttft)
    conv = turn.conversation
    a = plan.assessment
    svc.log.info(
        "turn",
        request_id=turn.request_id,
        conversation=conv.log_id if conv else None,
        turn=turn.index,
        outcome=outcome,
        action=plan.action.value,
        reason=plan.reason.value,
        matched_tokens=a.tokens if a else 0,
        tokens_planned_pull=plan.pull_tokens,
        tokens_cached=cached,
        tokens_computed=computed,
        prompt_tokens=n_prompt,
        generated_tokens=generated,
        prefill=run.prefill_url,
        decode=run.decode_url,
        render_ms=round(run.rendered.seconds * 1e3, 2),
        planned_ms=round(run.planned_s * 1e3, 2),
        admission_ms=round(run.journal.admission_s * 1e3, 2),
        prefill_ms=round((prefilled.seconds if prefilled else 0.0) * 1e3, 2),
        # P's time on it, its wait behind this gateway's earlier prefills there left out (the cost model's)
        prefill_served_ms=round(prefilled.served_s * 1e3, 2) if prefilled and prefilled.served_s is not None else None,
        ttft_ms=ttft_ms,
        capture=capture.value,
        retries=list(run.journal.retries) or None,
        estimates_ms=dict(plan.estimates) or None,
        charges_ms=dict(plan.charges) or None,
        load=dict(plan.load) or None,
        direct=plan.direct or None,
        ahead=plan.ahead.value if plan.ahead is not None else None,
        divergence=_divergence(run),
        conversation_source=conv.source if conv else None,
    )
