#!/usr/bin/env python3
"""Four hops on a GPU host: a render service, vLLM ``--tokens-only`` P and D, and turnkv deriving the turn.

Engines (vLLM >= 0.26, started by this script through gpu/devlib.py, or the simulator with
``TURNKV_GPU_BACKEND=sim``): a render service (``vllm launch render``, ``--reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser hermes``) on :8500, P ``--tokens-only`` on :8100 (prefix caching
off for the TTFT part: every reused token comes back from D), D ``--tokens-only`` with turnkv's plugin on :8200
(D's handle on a streamed generate), NIXL with bidirectional KV on both. The gateway runs ``engine:
vllm-four-hop`` on :8910 (with the model's tokenizer.json in process where the ``tokenizers`` package imports).

Parts, each within ``--time-budget-s`` (default 480 s, engine starts included), results in OUT/four_hop_<part>.json:

* ``ttft``: 8b shape, dummy weights. Conversations with a ``--history`` token system prompt (default 16k), five
  streamed turns each, through the four-hop gateway with a session (always-pull) and without one (plain: P
  recomputes every turn); TTFT per turn, the gateway's decision headers and turn events.
* ``two-hop``: the same conversations (same seed) on the standard pair (gpu/engines.py ``pair8b``, P's prefix
  cache off) through a two-hop gateway (always-pull, and plain) and straight to D (colocated). ``report``
  puts the two side by side: median TTFT of turn 5 per mode.
* ``correctness``: the history-sensitive model (gpu/make_sharp_model.py): five turns through four hops, greedy
  over one-token words, each answer against the same messages on a colocated engine (plain ``vllm serve``,
  :8400); on the "strip" template (sent per request) turnkv refuses or trims the reuse and stays correct,
  while a gateway reusing blindly (policy ``vllm-multiturn``) is checked to differ; and the render service's
  derender of a crafted answer with reasoning and a tool call, against turnkv's reading of the same ids.
* ``load``: 8b shape, 32 conversations x 4 turns in two waves through four hops: every turn answered, the
  decisions and failures counted.
* ``report``: reads OUT/four_hop_*.json and prints the comparison.

usage: four_hop.py ttft|two-hop|correctness|load|report|down [--out DIR] [--time-budget-s S] [--history N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devlib
import engines

M = devlib.MODEL_NAME
RENDER_PORT = 8500
COLOCATED_PORT = 8400
GATEWAY_PORT = 8910
TWO_HOP_PORT = 8911
TURNS = 5
START = time.monotonic()


def left(a: argparse.Namespace) -> float:
    return float(a.time_budget_s) - (time.monotonic() - START)


# -- engines ----------------------------------------------------------------------------------------


def render_command(model: str, trust_template: bool) -> tuple[list[str], dict[str, str]]:
    if devlib.backend() == "sim":  # its engines run --no-thinking (vLLM there has no reasoning parser either)
        cmd = [sys.executable, "-m", "turnkv", "sim", "--role", "render", "--host", devlib.HOST]
        cmd += ["--port", str(RENDER_PORT), "--model", M, "--time-scale", "1", "--max-model-len", "32768"]
        cmd += ["--no-thinking", "--no-reasoning-parser"]
        return cmd, {"PYTHONPATH": str(devlib.ROOT / "src")}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "launch", "render", model]
    cmd += ["--served-model-name", M, "--host", devlib.HOST, "--port", str(RENDER_PORT), "--max-model-len", "32768"]
    cmd += ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if trust_template:
        cmd.append("--trust-request-chat-template")
    return cmd, {"PYTHONPATH": devlib.pythonpath(devlib.VLLM_SITE)}


def start_render(model: str, *, trust_template: bool = False) -> str:
    cmd, env = render_command(model, trust_template)
    rec = devlib._spawn("render", cmd, env, f"http://{devlib.HOST}:{RENDER_PORT}", devlib.HEALTH_TIMEOUT_S)
    return str(rec["url"])


def four_hop_engines(
    model: str, *, p_cache: bool, dummy: bool, trust: bool = False, mem: float = 0.4
) -> list[devlib.EngineSpec]:
    common: dict[str, Any] = {"model": model, "mem": mem, "dummy": dummy}
    p_flags = ["--tokens-only", *([] if p_cache else ["--no-enable-prefix-caching"])]
    trust_flags = ["--trust-request-chat-template"] if trust else []
    return [
        devlib.EngineSpec(
            "p", "prefill", 8100, 5600, flags=[*p_flags, *trust_flags], sim_extra=["--tokens-only"], **common
        ),
        devlib.EngineSpec(
            "d",
            "decode",
            8200,
            5601,
            plugin=True,
            flags=["--tokens-only", *trust_flags],
            sim_extra=["--tokens-only", "--turnkv-plugin"],
            **common,
        ),
    ]


def tokenizer_setting(model: str) -> dict[str, Any]:
    """four_hop.tokenizer where the gateway's Python can read it (``tokenizers``), else none (then /detokenize)."""
    if devlib.backend() == "sim" or not (Path(model) / "tokenizer.json").exists():
        return {}
    probe = subprocess.run(
        [sys.executable, "-c", "import tokenizers"], env={**devlib.gateway_env(), "PATH": "/usr/bin:/bin"}, check=False
    )
    return {"tokenizer": model} if probe.returncode == 0 else {}


PLAIN = {"conversation_from_history": False}  # no session id and no conversation found: plain P/D


def four_hop_gateway(
    render: str,
    model: str,
    policy: str = "always-pull",
    *,
    name: str = "gw-four-hop",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    four_hop = tokenizer_setting(model)
    if devlib.backend() == "sim":
        four_hop["reasoning_parser"] = None  # as its render service
    settings = {"engine": "vllm-four-hop", "render": render, "four_hop": four_hop, "decision_headers": "full"}
    settings.update(extra or {})
    p, d = ["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"]
    port = GATEWAY_PORT if name == "gw-four-hop" else GATEWAY_PORT + 2
    return devlib.start_gateway(name, port, p, d, policy=policy, settings=settings)


# -- conversations ------------------------------------------------------------------------------------


class Words:
    def __init__(self, url: str, seed: int) -> None:
        self.words = [w for w, _ in devlib.words_for(url)]
        self.rng = random.Random(seed)

    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(n))


def conversation_specs(words: Words, n: int, history: int, user_tokens: int) -> list[dict[str, Any]]:
    return [{"system": words.text(history), "users": [words.text(user_tokens) for _ in range(TURNS)]} for _ in range(n)]


def chat(
    url: str, messages: list[dict[str, Any]], *, session: str | None, answer_tokens: int, extra: dict[str, Any]
) -> devlib.Reply:
    body = {"model": M, "messages": messages, "max_tokens": answer_tokens, "ignore_eos": True, "stream": True}
    body["temperature"] = 0.0
    body.update(extra)
    headers = {"X-Session-ID": session} if session else {}
    return devlib.post(url, "/v1/chat/completions", body, headers=headers)


def answer_of(rep: devlib.Reply) -> dict[str, Any]:
    content, reasoning, finish, error = "", "", None, None
    for c in devlib.chunks(rep):
        if not isinstance(c, dict):
            continue
        if "error" in c:
            error = c["error"]
        for ch in c.get("choices") or []:
            d = ch.get("delta") or {}
            content += d.get("content") or ""
            reasoning += d.get("reasoning") or ""
            finish = ch.get("finish_reason") or finish
    return {"content": content, "reasoning": reasoning, "finish": finish, "error": error}


def run_conversation(
    url: str, spec: dict[str, Any], mode: str, a: argparse.Namespace, turns: int = TURNS
) -> list[dict[str, Any]]:
    """Streamed turns; each answer goes back as history."""
    session = None if mode.endswith("plain") or mode == "colocated" else f"{mode}-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": spec["system"]}]
    rows = []
    for k, user in enumerate(spec["users"][:turns]):
        messages.append({"role": "user", "content": user})
        rep = chat(url, messages, session=session, answer_tokens=a.answer_tokens, extra={})
        ans = answer_of(rep)
        rows.append(
            {
                "turn": k + 1,
                "status": rep.status,
                "ttft_s": rep.first_token_s,
                "seconds": round(rep.seconds, 4),
                "finish": ans["finish"],
                "error": ans["error"],
                "decision": {h: v for h, v in rep.headers.items() if h.startswith("x-turnkv-")},
            }
        )
        messages.append({"role": "assistant", "content": ans["content"], "reasoning": ans["reasoning"] or None})
    return rows


def ttft_runs(urls: dict[str, str], a: argparse.Namespace, words_url: str) -> list[dict[str, Any]]:
    words = Words(words_url, a.seed)
    specs = conversation_specs(words, a.conversations, a.history, a.user_tokens)
    runs: list[dict[str, Any]] = []
    for i, spec in enumerate(specs):
        for mode, url in urls.items():
            if left(a) < 60:
                devlib.log("time budget: stopping")
                return runs
            t0 = time.monotonic()
            runs.append({"conversation": i, "mode": mode, "turns": run_conversation(url, spec, mode, a)})
            devlib.log(f"conversation {i} {mode}: {time.monotonic() - t0:.1f} s")
    return runs


# -- parts ----------------------------------------------------------------------------------------------


def part_ttft(a: argparse.Namespace) -> dict[str, Any]:
    model = str(devlib.KIT / "model-8b-keep")
    devlib.stop_all()
    render = start_render(model)
    for s in four_hop_engines(model, p_cache=False, dummy=True):
        devlib.start_engine(s)
    gw = four_hop_gateway(render, model)
    plain = four_hop_gateway(render, model, name="gw-four-hop-plain", extra=PLAIN)
    urls = {"four-hop": gw["url"], "four-hop-plain": plain["url"]}
    return {"engines": "four-hop", "history": a.history, "runs": ttft_runs(urls, a, render)}


def part_two_hop(a: argparse.Namespace) -> dict[str, Any]:
    devlib.stop_all()
    specs = engines.pair("8b", p_flags=["--no-enable-prefix-caching"])
    for s in specs:
        devlib.start_engine(s)
    p, d = [specs[0].url], [specs[1].url]
    gw = devlib.start_gateway(
        "gw-two-hop", TWO_HOP_PORT, p, d, policy="always-pull", settings={"decision_headers": "full"}
    )
    urls = {"two-hop": gw["url"], "two-hop-plain": gw["url"], "colocated": specs[1].url}
    return {"engines": "pair8b", "history": a.history, "runs": ttft_runs(urls, a, specs[0].url)}


def part_load(a: argparse.Namespace) -> dict[str, Any]:
    model = str(devlib.KIT / "model-8b-keep")
    devlib.stop_all()
    render = start_render(model)
    for s in four_hop_engines(model, p_cache=True, dummy=True):
        devlib.start_engine(s)
    gw = four_hop_gateway(render, model, policy="adaptive")
    words = Words(render, a.seed)
    waves = []
    for wave in range(2):
        specs = conversation_specs(words, 32, a.load_history, a.user_tokens)
        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda s: run_conversation(gw["url"], s, "four-hop", a, 4), specs))
        turns = [t for conv in results for t in conv]
        answered = sum(1 for t in turns if t["status"] == 200 and t["finish"] and not t["error"])
        reasons: dict[str, int] = {}
        for t in turns:
            r = t["decision"].get("x-turnkv-reason", "")
            reasons[r] = reasons.get(r, 0) + 1
        seconds = round(time.monotonic() - t0, 1)
        waves.append({"wave": wave + 1, "turns": len(turns), "answered": answered, "reasons": reasons, "s": seconds})
        devlib.log(f"wave {wave + 1}: {answered}/{len(turns)} turns answered")
        if left(a) < 120:
            break
    return {"conversations": 32, "turns_each": 4, "waves": waves}


def part_correctness(a: argparse.Namespace) -> dict[str, Any]:
    model = str(devlib.SHARP_MODEL)
    dummy = False
    devlib.stop_all()
    render = start_render(model, trust_template=True)
    for s in four_hop_engines(model, p_cache=False, dummy=dummy, trust=True, mem=0.25):
        devlib.start_engine(s)
    colocated = devlib.EngineSpec(
        "colocated",
        "colocated",
        COLOCATED_PORT,
        5610,
        model=model,
        mem=0.25,
        dummy=dummy,
        flags=["--trust-request-chat-template"],
    )
    devlib.start_engine(colocated)
    words = Words(render, a.seed)
    allowed = [t for _, t in devlib.words_for(render)][:500]
    out: dict[str, Any] = {"derender": derender_round_trip(render)}
    strip_config = devlib.KIT / "model-1b-strip" / "tokenizer_config.json"
    for template, policy in (("keep", "always-pull"), ("strip", "always-pull"), ("strip", "vllm-multiturn")):
        extra: dict[str, Any] = {"allowed_token_ids": allowed}
        if template == "strip":
            if not strip_config.exists():
                out[f"{template}-{policy}"] = "no strip template here (gpu/setup.sh writes it)"
                continue
            extra["chat_template"] = json.loads(strip_config.read_text())["chat_template"]
        gw = four_hop_gateway(render, model, policy=policy)
        rows = compare_turns(gw["url"], colocated.url, words, extra, a)
        out[f"{template}-{policy}"] = rows
        devlib.stop("gw-four-hop")
        if left(a) < 90:
            break
    return out


def compare_turns(gw: str, colocated: str, words: Words, extra: dict[str, Any], a: argparse.Namespace) -> list[Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": words.text(200)}]
    session = f"corr-{uuid.uuid4().hex[:8]}"
    rows = []
    for k in range(TURNS):
        messages.append({"role": "user", "content": words.text(40)})
        rep = chat(gw, messages, session=session, answer_tokens=32, extra=extra)
        got = answer_of(rep)
        truth = answer_of(chat(colocated, messages, session=None, answer_tokens=32, extra=extra))
        decision = {h: v for h, v in rep.headers.items() if h in ("x-turnkv-outcome", "x-turnkv-reason")}
        rows.append({"turn": k + 1, "same": got["content"] == truth["content"], **decision})
        messages.append({"role": "assistant", "content": got["content"], "reasoning_content": words.text(8)})
    return rows


def derender_round_trip(render: str) -> dict[str, Any]:
    """The render service's derender of a crafted answer (reasoning, then a tool call), and what turnkv's reading
    of the same ids streams: the parsers turnkv mirrors, checked against vLLM's own."""
    sys.path.insert(0, str(devlib.ROOT / "src"))
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"<think>\nthe user wants weather\n</think>\n\nChecking.\n<tool_call>\n{call}\n</tool_call>"
    tok = devlib.post(render, "/tokenize", {"model": M, "prompt": text, "add_special_tokens": False})
    ids = (tok.json or {}).get("tokens")
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    chat_request = {"model": M, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools}
    body = {
        "model": M,
        "generate_response": {"request_id": "x", "choices": [{"index": 0, "finish_reason": "stop", "token_ids": ids}]},
        "prompt_tokens": 10,
        "chat_request": chat_request,
    }
    rep = devlib.post(render, "/v1/chat/completions/derender", body)
    from turnkv.derender.markup import Markup, MarkupSplitter

    s = MarkupSplitter(Markup(), reasoning_open=True, parse_tools=True)
    detok = (devlib.post(render, "/detokenize", {"model": M, "tokens": ids}).json or {}).get("prompt", "")
    split = s.feed(detok)
    end = s.finish()
    msg = ((rep.json or {}).get("choices") or [{}])[0].get("message") or {}
    return {
        "status": rep.status,
        "vllm": {"content": msg.get("content"), "reasoning": msg.get("reasoning"), "tool_calls": msg.get("tool_calls")},
        "turnkv_streamed": {"reasoning": split.reasoning + end.reasoning, "content": split.content + end.content},
        "detokenized": detok,
    }


def report(out: Path) -> int:
    rows: dict[str, list[float]] = {}
    for f in sorted(out.glob("four_hop_*.json")):
        data = json.loads(f.read_text())
        for run in data.get("runs") or []:
            t5 = [t["ttft_s"] for t in run["turns"] if t["turn"] == TURNS and t["ttft_s"] is not None]
            rows.setdefault(run["mode"], []).extend(t5)
    base = statistics.median(rows["two-hop"]) if rows.get("two-hop") else None
    for mode, v in sorted(rows.items()):
        med = statistics.median(v) if v else float("nan")
        ratio = f"{med / base:.2f}x two-hop" if base else ""
        print(f"{mode:16} TTFT_{TURNS} median {med * 1e3:8.1f} ms over {len(v)} conversations {ratio}")
    return 0


PARTS = {"ttft": part_ttft, "two-hop": part_two_hop, "correctness": part_correctness, "load": part_load}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=[*PARTS, "report", "down"])
    ap.add_argument("--out", default=str(devlib.ROOT / "results" / "gpu"))
    ap.add_argument("--time-budget-s", type=float, default=480.0)
    ap.add_argument("--history", type=int, default=16384, help="system prompt tokens (ttft, two-hop)")
    ap.add_argument("--load-history", type=int, default=2048, help="system prompt tokens (load)")
    ap.add_argument("--user-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=100)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.part == "down":
        devlib.stop_all()
        return 0
    if a.part == "report":
        return report(out)
    result = {"part": a.part, "backend": devlib.backend(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    result.update(PARTS[a.part](a))
    devlib.write_json(out / f"four_hop_{a.part.replace('-', '_')}.json", result)
    devlib.log(f"wrote {out / f'four_hop_{a.part}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
