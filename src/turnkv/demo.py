"""``turnkv demo``: simulated P and D engines, the gateway, and a five-turn agent conversation, all local.

Runs the conversation twice through the official ``openai`` client: on a chat template that keeps
earlier reasoning (D's KV is reused every later turn) and on one that strips it as Qwen3's does (the
reuse is refused or trimmed, and the reason shown). P's prefix cache is off, as after an eviction or
on another prefill instance, so every reused token is one that came back from the decode engine.
Each answer is checked against a colocated engine given the same history.

``--four-hop``: the engines run ``--tokens-only`` behind a simulated render service (render, P generate, D
generate, derender); each answer is checked against the colocated engine's non-streamed one (what vLLM's
non-streaming derender says: a streamed answer adds up to it).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import openai
from openai.types.chat import ChatCompletionChunk

from turnkv import launch

SYSTEM = (
    "You are a travel planning agent. Work step by step, call the lookup tool when you need facts about "
    "places, prices or opening times, and keep every answer short. Prefer trains over flights when the "
    "journey is under six hours, and always mention one thing to see that is free of charge. "
) * 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up facts about a place",
            "parameters": {
                "type": "object",
                "properties": {"place": {"type": "string"}, "topic": {"type": "string"}},
                "required": ["place"],
            },
        },
    }
]
USER_TURNS = [
    "Plan two days in Lyon for me.",
    "What about the evening of day one?",
    "Is the museum open on Monday?",
    "Find a cheaper hotel near the station.",
    "Summarise the plan in three lines.",
]


def _stream(client: openai.OpenAI, messages: list[dict[str, Any]], session: str | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    raw = client.chat.completions.with_raw_response.create(
        model="sim-model",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=160,
        stream=True,
        extra_headers={"X-Session-ID": session} if session else None,
    )
    content, reasoning = "", ""
    calls: dict[int, dict[str, str]] = {}
    for chunk in cast("openai.Stream[ChatCompletionChunk]", raw.parse()):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta.model_dump()
        if ttft is None and (d.get("content") or d.get("reasoning") or d.get("tool_calls")):
            ttft = time.perf_counter() - t0
        content += d.get("content") or ""
        reasoning += d.get("reasoning") or ""
        for tc in d.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            slot["name"] += (tc.get("function") or {}).get("name") or ""
            slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    return {
        "content": content,
        "reasoning": reasoning,
        "calls": [calls[i] for i in sorted(calls)],
        "ttft_ms": (ttft or 0.0) * 1e3,
        "headers": dict(raw.headers),
    }


def _whole(client: openai.OpenAI, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer not streamed, in ``_stream``'s shape (no content is "", as a stream without content says)."""
    m = (
        client.chat.completions.create(
            model="sim-model",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=160,
        )
        .choices[0]
        .message.model_dump()
    )
    calls = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in m.get("tool_calls") or []
    ]
    return {"content": m.get("content") or "", "reasoning": m.get("reasoning") or "", "calls": calls}


def _answer(a: dict[str, Any]) -> tuple[Any, ...]:
    return a["content"], a["reasoning"], [(c["name"], c["arguments"]) for c in a["calls"]]


def _next_messages(messages: list[dict[str, Any]], a: dict[str, Any], user: str) -> list[dict[str, Any]]:
    msg: dict[str, Any] = {"role": "assistant", "content": a["content"], "reasoning": a["reasoning"]}
    if not a["calls"]:
        return [*messages, msg, {"role": "user", "content": user}]
    msg["tool_calls"] = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in a["calls"]
    ]
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": f"{c['name']}: open daily, 12 EUR"} for c in a["calls"]
    ]
    return [*messages, msg, *results]


def _conversation(gateway: str, truth: str, turns: int, session: str, *, whole_truth: bool) -> list[dict[str, Any]]:
    rows = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
    with (
        openai.OpenAI(base_url=gateway + "/v1", api_key="demo", max_retries=0) as gw,
        openai.OpenAI(base_url=truth + "/v1", api_key="demo", max_retries=0) as colocated,
    ):
        for k in range(turns):
            a = _stream(gw, messages, session)
            b = _whole(colocated, messages) if whole_truth else _stream(colocated, messages, None)
            h = a["headers"]
            prompt = int(h.get("x-turnkv-prompt-tokens", 0))
            cached = int(h.get("x-turnkv-prefill-cached-tokens", 0))
            rows.append(
                {
                    "turn": k + 1,
                    "ttft_ms": a["ttft_ms"],
                    "prompt": prompt,
                    "reused": cached,
                    "computed": prompt - cached,
                    "decision": f"{h.get('x-turnkv-outcome')}/{h.get('x-turnkv-action')}",
                    "reason": h.get("x-turnkv-reason", ""),
                    "correct": _answer(a) == _answer(b),
                }
            )
            messages = _next_messages(messages, a, USER_TURNS[(k + 1) % len(USER_TURNS)])
    return rows


def _table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'turn':>4}  {'TTFT ms':>8}  {'prompt':>6}  {'reused':>6}  {'computed':>8}  {'decision':<18}  "
        f"{'reason':<20}  same as colocated"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['turn']:>4}  {r['ttft_ms']:>8.1f}  {r['prompt']:>6}  {r['reused']:>6}  {r['computed']:>8}  "
            f"{r['decision']:<18}  {r['reason']:<20}  {'yes' if r['correct'] else 'NO'}"
        )
    return "\n".join(lines)


def run(
    turns: int = 5,
    policy: str = "always-pull",
    link: str = "rdma400",
    logs: Path | None = None,
    *,
    four_hop: bool = False,
) -> int:
    """Run the demo; returns the exit status (1 if any answer differed from the colocated engine)."""
    ok = True
    with tempfile.TemporaryDirectory(prefix="turnkv-demo-") as tmp:
        log_dir = logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        hops = "four hops (render service, tokens-only P and D, derender)" if four_hop else "P/D"
        print(
            f"turnkv demo: simulated vLLM 0.33 engines (link {link}, Qwen3-8B timings) over {hops}, policy {policy}, "
            f"P prefix cache off (every reused token comes back from D)\n"
        )
        for template, what in (
            ("keep", "keeps earlier reasoning: D's KV is reused"),
            ("strip", "drops earlier reasoning, as Qwen3's does: reuse is refused or trimmed"),
        ):
            flags = ("--template", template, "--vllm-compat", "0.33", "--link", link, "--enable-prompt-tokens-details")
            tokens = ("--tokens-only",) if four_hop else ()
            p = launch.sim(f"prefill-{template}", "prefill", *flags, *tokens, "--no-prefix-caching", log_dir=log_dir)
            plugin = ("--turnkv-plugin",) if four_hop else ()
            d = launch.sim(f"decode-{template}", "decode", *flags, *tokens, *plugin, log_dir=log_dir)
            t = launch.sim(f"colocated-{template}", "colocated", *flags, log_dir=log_dir)
            procs = [p, d, t]
            env = {"TURNKV_DECISION_HEADERS": "full"}  # the table shows token counts
            if four_hop:
                r = launch.sim(f"render-{template}", "render", *flags[:4], log_dir=log_dir)
                procs.append(r)
                env.update(TURNKV_ENGINE="vllm-four-hop", TURNKV_RENDER=r.url)
            g = launch.gateway(f"gateway-{template}", [p.url], [d.url], "--policy", policy, log_dir=log_dir, env=env)
            with launch.running(*procs, g):
                rows = _conversation(g.url, t.url, turns, session=f"demo-{template}", whole_truth=four_hop)
            print(f'template "{template}": {what}')
            print(_table(rows) + "\n")
            ok = ok and all(r["correct"] for r in rows)
        print("Every answer matched the colocated engine." if ok else "MISMATCH: an answer differed from colocated.")
    return 0 if ok else 1
