#!/usr/bin/env python3
"""Correctness on the real engines: a planted mismatch changes the answer; turnkv's answers do not.

Needs a model whose output depends on its history (gpu/make_sharp_model.py; dummy weights
ignore the history). Engines: gpu/engines.py ``trio`` (P without prefix caching, so P pulls every
block D holds that it is given a handle for; D0 without the plugin; D1 with it).

Conversations are made of words that are one token each (checked with ``/tokenize``), and answers
are restricted to such words (``allowed_token_ids``, greedy, ``ignore_eos``), so an answer re-sent as
history tokenizes to the ids D generated. Each turn asks the engine to continue an assistant message
that opens with a reasoning block (``continue_final_message``): the next turn re-sends it as
``reasoning_content``, which the "keep" template renders again and the "strip" template (as Qwen3's)
drops from earlier turns. The strip template is sent per request (``chat_template``; the engines run
with ``--trust-request-chat-template``).

Parts (results in OUT/correctness.json, a summary on stdout):
1. ``weights``: vLLM's greedy first token equals the numpy reference of the same weights (vLLM only).
2. ``sensitivity``: changing one word of the first user message changes the greedy answer.
3. ``planted``: turn 1 through P and D; turn 2 sent to P with D's handle blindly (as vLLM's example
   proxy does) versus recomputed: on "strip" the answers differ (the mismatch matters), on "keep"
   they agree (reuse itself is sound).
4. ``turnkv``: 5+ turns through ``turnkv serve`` (always-pull) on both templates, non-streaming and
   streaming (the plugin carries D's handle on 0.26), each turn compared with the same messages
   recomputed on D0 (its own ``cache_salt``: no prefix-cache sharing). Greedy ids are compared, and
   the first token's logprob with a tolerance: D's KV from decoding may differ from P's recomputed KV
   in bf16 rounding, which is a wobble, not a wrong answer.
5. ``plugin_effect``: streamed turns through turnkv with D0 (no plugin) never reuse; with D1 they do.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devlib
import engines

M = devlib.MODEL_NAME
P_ONLY = devlib.P_ONLY
LOGPROB_TOL = 0.1  # nats, for the first token's logprob (bf16 KV from decode vs recompute)
GATEWAY_PORT = 8900


@dataclass
class Target:
    """Where one template's requests go, and what they add to every body."""

    template: str
    p: str
    d_plain: str  # D0, no plugin
    d_plugin: str  # D1
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    user: str
    reasoning: str
    answer: str = ""  # "Answer" + generated text


@dataclass
class Conversation:
    system: str
    turns: list[Turn]

    def messages(self, k: int) -> list[dict[str, Any]]:
        """Turn k's messages (0-based): the history with earlier answers and their reasoning, the
        user message, and the assistant message to continue (reasoning block, then "Answer")."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for t in self.turns[:k]:
            msgs.append({"role": "user", "content": t.user})
            msgs.append({"role": "assistant", "reasoning_content": t.reasoning, "content": t.answer})
        cur = self.turns[k]
        msgs.append({"role": "user", "content": cur.user})
        msgs.append({"role": "assistant", "content": f"<think>\n{cur.reasoning}\n</think>\n\nAnswer:"})
        return msgs


class Words:
    def __init__(self, pairs: list[tuple[str, int]], n_allowed: int) -> None:
        self.words = [w for w, _ in pairs]
        self.allowed = [i for _, i in pairs[:n_allowed]]

    def text(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(self.words) for _ in range(n))

    def conversation(self, rng: random.Random, turns: int, history: int, user: int, reasoning: int) -> Conversation:
        return Conversation(
            self.text(rng, history), [Turn(self.text(rng, user), self.text(rng, reasoning)) for _ in range(turns)]
        )


def body(msgs: list[dict[str, Any]], words: Words, answer_tokens: int, target: Target, **extra: Any) -> dict[str, Any]:
    return {
        "model": M,
        "messages": msgs,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": answer_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "allowed_token_ids": words.allowed,
        "logprobs": True,
        "top_logprobs": 5,
        "return_token_ids": True,
        **target.extra,
        **extra,
    }


@dataclass
class Answer:
    text: str
    ids: list[int]
    first: dict[str, Any] | None  # first token's logprob entry
    prompt_ids: list[int] | None
    headers: dict[str, str]
    kv: dict[str, Any] | None
    status: int
    seconds: float


def parse(rep: devlib.Reply) -> Answer:
    hdr = {k: v for k, v in rep.headers.items() if k.startswith("x-turnkv")}
    if rep.status != 200:
        return Answer(rep.raw[:300], [], None, None, hdr, None, rep.status, rep.seconds)
    if rep.events is not None:
        text, ids, first, prompt, kv = "", [], None, None, None
        for c in devlib.chunks(rep):
            if not isinstance(c, dict):
                continue
            prompt = c.get("prompt_token_ids") or prompt
            if isinstance(c.get("kv_transfer_params"), dict):
                kv = c["kv_transfer_params"]
            for ch in c.get("choices") or []:
                text += (ch.get("delta") or {}).get("content") or ""
                ids += ch.get("token_ids") or []
                lp = (ch.get("logprobs") or {}).get("content") or []
                if first is None and lp:
                    first = lp[0]
        return Answer(text, ids, first, prompt, hdr, kv, rep.status, rep.seconds)
    j = rep.json or {}
    ch = (j.get("choices") or [{}])[0]
    lp = (ch.get("logprobs") or {}).get("content") or []
    return Answer(
        (ch.get("message") or {}).get("content") or "",
        ch.get("token_ids") or [],
        lp[0] if lp else None,
        j.get("prompt_token_ids"),
        hdr,
        j.get("kv_transfer_params"),
        rep.status,
        rep.seconds,
    )


def compare(a: Answer, b: Answer) -> dict[str, Any]:
    """a (reuse or turnkv) against b (recomputed)."""
    out: dict[str, Any] = {"ids_equal": a.ids == b.ids and bool(a.ids), "status": [a.status, b.status]}
    if a.ids != b.ids:
        n = next((i for i, (x, y) in enumerate(zip(a.ids, b.ids, strict=False)) if x != y), min(len(a.ids), len(b.ids)))
        out["first_difference_at"] = n
    fa, fb = a.first or {}, b.first or {}
    out["first_token_equal"] = bool(a.ids and b.ids and a.ids[0] == b.ids[0])
    if fa.get("token") is not None and fa.get("token") == fb.get("token"):
        out["first_logprob_delta"] = abs(float(fa["logprob"]) - float(fb["logprob"]))
        ta = {t["token"]: t["logprob"] for t in fa.get("top_logprobs") or []}
        tb = {t["token"]: t["logprob"] for t in fb.get("top_logprobs") or []}
        common = set(ta) & set(tb)
        out["top5_common"] = len(common)
        out["top5_max_delta"] = max((abs(ta[t] - tb[t]) for t in common), default=None)
    out["within_tolerance"] = out["first_token_equal"] and out.get("first_logprob_delta", 0.0) <= LOGPROB_TOL
    return out


def recompute(msgs: list[dict[str, Any]], words: Words, n: int, target: Target, salt: str) -> Answer:
    """The answer with no reuse at all: D0 alone (colocated), with a prefix cache of its own (salt)."""
    return parse(devlib.post(target.d_plain, "/v1/chat/completions", body(msgs, words, n, target, cache_salt=salt)))


def pd(
    msgs: list[dict[str, Any]],
    words: Words,
    n: int,
    target: Target,
    *,
    handle: dict[str, Any] | None,
    salt: str,
    decode: str,
    stream: bool = False,
) -> tuple[Answer, dict[str, Any]]:
    """One turn through P and D as vLLM's proxies send it; with ``handle``, P gets D's handle blindly."""
    b = body(msgs, words, n, target, cache_salt=salt)
    pb = {k: v for k, v in b.items() if k not in ("logprobs", "top_logprobs", "return_token_ids")}
    pb.update(max_tokens=1, stream=False, kv_transfer_params=handle or P_ONLY)
    before = devlib.metrics(target.p)
    prep = devlib.post(target.p, "/v1/chat/completions", pb)
    pulled = devlib.nixl_delta(before, devlib.metrics(target.p))
    if prep.status != 200 or not isinstance((prep.json or {}).get("kv_transfer_params"), dict):
        return Answer(prep.raw[:300], [], None, None, {}, None, prep.status, prep.seconds), pulled
    b["kv_transfer_params"] = prep.json["kv_transfer_params"]
    b["stream"] = stream
    return parse(devlib.post(decode, "/v1/chat/completions", b)), pulled


# -- parts ---------------------------------------------------------------------------------------


def part_weights(words: Words, target: Target, rng: random.Random) -> dict[str, Any]:
    if devlib.backend() != "vllm":
        return {"skipped": "no weights on the simulator"}
    import numpy as np
    from make_sharp_model import forward, load

    w, shape = load(Path(engines.SHARP))
    rows = []
    for _ in range(2):
        conv = words.conversation(rng, 1, 60, 12, 8)
        msgs = conv.messages(0)
        ans = recompute(msgs, words, 1, target, salt=uuid.uuid4().hex)
        if not ans.prompt_ids or not ans.ids:
            rows.append({"error": ans.text})
            continue
        logits = forward(w, shape, ans.prompt_ids)
        allowed = np.asarray(words.allowed)
        ref = int(allowed[int(np.argmax(logits[allowed]))])
        lse = float(np.log(np.sum(np.exp(logits - logits.max()))) + logits.max())
        rows.append(
            {
                "prompt_tokens": len(ans.prompt_ids),
                "vllm_first": ans.ids[0],
                "numpy_first": ref,
                "equal": ans.ids[0] == ref,
                "vllm_logprob": (ans.first or {}).get("logprob"),
                "numpy_logprob": float(logits[ref] - lse),
            }
        )
    return {"rows": rows, "all_equal": all(r.get("equal") for r in rows)}


def part_sensitivity(words: Words, target: Target, rng: random.Random, trials: int, n: int) -> dict[str, Any]:
    changed_first = changed_any = 0
    rows = []
    for _ in range(trials):
        conv = words.conversation(rng, 1, 120, 30, 12)
        a = recompute(conv.messages(0), words, n, target, salt=uuid.uuid4().hex)
        user = conv.turns[0].user.split(" ")
        j = rng.randrange(len(user))
        user[j] = rng.choice([x for x in words.words if x != user[j]])
        conv.turns[0].user = " ".join(user)
        b = recompute(conv.messages(0), words, n, target, salt=uuid.uuid4().hex)
        c = compare(a, b)
        changed_first += int(not c["first_token_equal"])
        changed_any += int(not c["ids_equal"])
        rows.append(c)
    return {"trials": trials, "first_token_changed": changed_first, "answer_changed": changed_any, "rows": rows}


def part_planted(words: Words, target: Target, rng: random.Random, trials: int, n: int, args: Any) -> dict[str, Any]:
    rows = []
    for _ in range(trials):
        conv = words.conversation(rng, 2, args.history_words, args.user_words, args.reasoning_words)
        salt = uuid.uuid4().hex
        t1, _ = pd(conv.messages(0), words, n, target, handle=None, salt=salt + "-t1", decode=target.d_plugin)
        if t1.status != 200 or not t1.kv:
            rows.append({"error": f"turn 1: {t1.status} {t1.text[:200]}"})
            continue
        conv.turns[0].answer = "Answer:" + t1.text
        msgs2 = conv.messages(1)
        ref = recompute(msgs2, words, n, target, salt=salt + "-ref")
        blind, pulled = pd(msgs2, words, n, target, handle=t1.kv, salt=salt + "-blind", decode=target.d_plugin)
        row = compare(blind, ref)
        row.update(
            handle_tokens=t1.kv.get("remote_num_tokens"),
            prompt_tokens=len(ref.prompt_ids or []),
            pulled=pulled,
            blind_status=blind.status,
        )
        rows.append(row)
    differ = sum(1 for r in rows if "ids_equal" in r and not r["ids_equal"])
    return {"trials": trials, "answers_differ": differ, "rows": rows}


def part_turnkv(
    words: Words, target: Target, rng: random.Random, args: Any, *, gateway: str, stream: bool, turns: int, label: str
) -> dict[str, Any]:
    conv = words.conversation(rng, turns, args.history_words, args.user_words, args.reasoning_words)
    session = f"{label}-{uuid.uuid4().hex[:8]}"
    rows = []
    for k in range(turns):
        msgs = conv.messages(k)
        b = body(msgs, words, args.answer_tokens, target, stream=stream)
        got = parse(devlib.post(gateway, "/v1/chat/completions", b, headers={"x-session-id": session}))
        ref = recompute(msgs, words, args.answer_tokens, target, salt=f"{session}-ref-{k}")
        row = {"turn": k + 1, **compare(got, ref), "turnkv": got.headers, "turnkv_seconds": round(got.seconds, 3)}
        rows.append(row)
        if got.status != 200:
            break
        conv.turns[k].answer = "Answer:" + got.text
    ok = [r for r in rows if r["status"] == [200, 200]]
    return {
        "turns": len(rows),
        "ids_equal": sum(r["ids_equal"] for r in ok),
        "within_tolerance": sum(r["within_tolerance"] for r in ok),
        "reused_turns": sum(1 for r in ok if int(r["turnkv"].get("x-turnkv-pulled-tokens", "0") or 0) > 0),
        "rows": rows,
    }


def gateway_settings() -> dict[str, Any]:
    """The sharp model's KV size, and the engines' defaults."""
    return {"kv_bytes_per_token": 2 * 4 * 8 * 128 * 2, "health_interval_s": 1.0, "scrape_interval_s": 2.0}


def targets() -> tuple[list[Target], dict[str, Any]]:
    keep, note = engines.start_trio()
    d_plugin = keep[2].url if note.get("plugin_engine") else keep[1].url  # without D1: streams capture nothing
    if devlib.backend() == "vllm":
        tc = json.loads((devlib.KIT / "model-1b-strip" / "tokenizer_config.json").read_text())
        strip = Target("strip", keep[0].url, keep[1].url, d_plugin, {"chat_template": tc["chat_template"]})
    else:  # the simulator takes its template at start: a second trio
        s = engines.trio(template="strip", base_port=8110)
        for spec in s:
            devlib.start_engine(spec)
        strip = Target("strip", s[0].url, s[1].url, s[2].url)
    return [Target("keep", keep[0].url, keep[1].url, d_plugin), strip], note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--history-words", type=int, default=200)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--reasoning-words", type=int, default=30)
    ap.add_argument("--trials", type=int, default=3, help="planted-mismatch conversations per template")
    ap.add_argument("--sensitivity-trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--parts", default="weights,sensitivity,planted,turnkv,plugin_effect")
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    t_start = time.perf_counter()
    (keep, strip), note = targets()
    words = Words(devlib.words_for(keep.p, 1200), 400)
    rng = random.Random(a.seed)
    res: dict[str, Any] = {
        "backend": devlib.backend(),
        "args": vars(a),
        "allowed_words": len(words.allowed),
        "trio": note,
    }
    if not note.get("history_sensitive", True):
        res["warning"] = "the history-sensitive model did not load: dummy weights, equal answers prove nothing"
        parts -= {"weights"}

    def timed(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        res[name] = fn()
        res[name + "_seconds"] = round(time.perf_counter() - t0, 1)
        devlib.log(f"{name}: done in {res[name + '_seconds']} s")

    if "weights" in parts:
        timed("weights", lambda: part_weights(words, keep, rng))
    if "sensitivity" in parts:
        timed("sensitivity", lambda: part_sensitivity(words, keep, rng, a.sensitivity_trials, a.answer_tokens))
    if "planted" in parts:
        timed(
            "planted",
            lambda: {t.template: part_planted(words, t, rng, a.trials, a.answer_tokens, a) for t in (strip, keep)},
        )
    if "turnkv" in parts:
        out: dict[str, Any] = {}
        for t in (keep, strip):
            with devlib.gateway(
                "gw", GATEWAY_PORT, [t.p], [t.d_plugin], policy="always-pull", settings=gateway_settings()
            ) as gw:
                for stream in (False, True):
                    key = f"{t.template}_{'stream' if stream else 'json'}"
                    out[key] = part_turnkv(words, t, rng, a, gateway=gw, stream=stream, turns=a.turns, label=key)
                    devlib.log(
                        f"turnkv {key}: {out[key]['ids_equal']}/{out[key]['turns']} equal, "
                        f"{out[key]['reused_turns']} reused"
                    )
        res["turnkv"] = out
    if "plugin_effect" in parts:
        eff: dict[str, Any] = {}
        for label, d in (("without_plugin", keep.d_plain), ("with_plugin", keep.d_plugin)):
            with devlib.gateway(
                "gw", GATEWAY_PORT, [keep.p], [d], policy="always-pull", settings=gateway_settings()
            ) as gw:
                r = part_turnkv(words, keep, rng, a, gateway=gw, stream=True, turns=3, label=label)
                eff[label] = {
                    "outcomes": [row["turnkv"].get("x-turnkv-outcome") for row in r["rows"]],
                    "reasons": [row["turnkv"].get("x-turnkv-reason") for row in r["rows"]],
                    "reused_turns": r["reused_turns"],
                }
        res["plugin_effect"] = eff
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    devlib.write_json(devlib.out_dir() / "correctness.json", res)
    print(json.dumps(summary(res), indent=1))
    return 0


def summary(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"seconds": res.get("seconds"), "trio": res.get("trio"), "warning": res.get("warning")}
    if isinstance(res.get("weights"), dict):
        s["weights_match_numpy"] = res["weights"].get("all_equal", res["weights"].get("skipped"))
    if "sensitivity" in res:
        r = res["sensitivity"]
        s["one_word_changes_answer"] = f"{r['answer_changed']}/{r['trials']} (first token {r['first_token_changed']})"
    if "planted" in res:
        s["planted_answers_differ"] = {k: f"{v['answers_differ']}/{v['trials']}" for k, v in res["planted"].items()}
    if "turnkv" in res:
        s["turnkv_vs_recompute"] = {
            k: f"ids equal {v['ids_equal']}/{v['turns']}, within tolerance "
            f"{v['within_tolerance']}/{v['turns']}, reused {v['reused_turns']}"
            for k, v in res["turnkv"].items()
        }
        deltas = [
            r.get("first_logprob_delta")
            for v in res["turnkv"].values()
            for r in v["rows"]
            if r.get("first_logprob_delta") is not None
        ]
        s["max_first_logprob_delta"] = max(deltas, default=None)
    if "plugin_effect" in res:
        s["plugin_effect"] = res["plugin_effect"]
    return s


if __name__ == "__main__":
    sys.exit(main())
