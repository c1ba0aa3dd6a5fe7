#!/usr/bin/env python3
"""Record vLLM's responses to a fixed set of P/D requests as JSON fixtures, and check the plugin.

Runs on the GPU host against the engines gpu/engines.py starts (the "trio": prefill P on :8100,
decode D0 on :8200 without the turnkv plugin, decode D1 on :8300 with it), or, with
``TURNKV_GPU_BACKEND=sim``, against turnkv's simulator (to test this script, and to write the
simulator's own self-check fixtures). Each case is a short flow (P then D, a second turn with D's
handle, a single utility call ...); tests/compat/protocol.py runs the steps and captures responses,
the same code the CI test replays them with. Values that vary run to run (ids, timestamps, engine and
block ids) are kept; the comparison looks at shapes only.

Groups: ``main`` (everything that leaves the engines as they were) and ``pull_failures`` (an expired
and a refused pull, which end a P request with a KV-load failure); run the second last.

Writes OUT/fixtures-<group>.tgz (the case files, for tests/fixtures/vllm/<version>/) and
OUT/plugin_check.json (what the plugin changed on D1, against D0 and against the rules of 0.33).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import devlib
import engines
from tests.compat import protocol

M = devlib.MODEL_NAME
P_ONLY = devlib.P_ONLY
FAKE_ENGINE_ID = "00000000-0000-4000-8000-000000000000"
SYSTEM = "You answer questions about the files of a small project."
USER = "Which function opens the configuration file and what does it return"
USER2 = "And where is that function called from"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
ANSWER = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}
# what the simulator needs to stand in for the recorded engines (tests/compat replays with these)
SIM_FLAGS = [
    "--vllm-compat",
    "0.26",
    "--model",
    M,
    "--max-model-len",
    "32768",
    "--block-size",
    "16",
    "--no-thinking",
    "--time-scale",
    "0",
]
PLUGIN_REPLAY = {"engines": {"decode_plugin": "decode"}, "drop_stream_keys": ["kv_transfer_params"]}


def p_chat(name: str = "prefill", messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """P's request as vLLM's proxies build it: the client body, stream off, one token, do_remote_decode."""
    return {
        "name": name,
        "engine": "prefill",
        "path": "/v1/chat/completions",
        "body": {
            "model": M,
            "messages": messages or MESSAGES,
            "stream": False,
            "max_tokens": 1,
            "kv_transfer_params": P_ONLY,
        },
    }


def d_chat(
    engine: str,
    *,
    stream: bool,
    ids: bool = False,
    usage: bool = False,
    continuous: bool = False,
    name: str = "decode",
    p_step: str = "prefill",
    messages: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": M, "messages": messages or MESSAGES, **ANSWER, "stream": stream}
    if ids:
        body["return_token_ids"] = True
    if usage:
        body["stream_options"] = {"include_usage": True, **({"continuous_usage_stats": True} if continuous else {})}
    body["kv_transfer_params"] = None
    return {
        "name": name,
        "engine": engine,
        "path": "/v1/chat/completions",
        "body": body,
        "bind": [{"to": ["kv_transfer_params"], "from": p_step, "take": ["json", "kv_transfer_params"]}],
    }


def render_step() -> dict[str, Any]:
    return {
        "name": "render",
        "engine": "prefill",
        "path": "/v1/chat/completions/render",
        "body": {"model": M, "messages": MESSAGES, "max_tokens": 8},
    }


def p_completions() -> dict[str, Any]:
    """P's request as turnkv builds it on 0.26: the rendered ids as a completions prompt."""
    return {
        "name": "prefill",
        "engine": "prefill",
        "path": "/v1/completions",
        "body": {"model": M, "prompt": None, "max_tokens": 1, "stream": False, "kv_transfer_params": P_ONLY},
        "bind": [{"to": ["prompt"], "from": "render", "take": ["json", "token_ids"]}],
    }


def d_completions(engine: str, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": M,
        "prompt": None,
        **ANSWER,
        "stream": stream,
        "return_token_ids": True,
        "kv_transfer_params": None,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return {
        "name": "decode",
        "engine": engine,
        "path": "/v1/completions",
        "body": body,
        "bind": [
            {"to": ["prompt"], "from": "render", "take": ["json", "token_ids"]},
            {"to": ["kv_transfer_params"], "from": "prefill", "take": ["json", "kv_transfer_params"]},
        ],
    }


def second_turn(tag: str, edit: dict[str, Any] | None, *, decode: bool) -> list[dict[str, Any]]:
    """Turn 1 through P and D0, then turn 2's P request with D0's handle (as vLLM's multi-turn proxy
    sends it), optionally edited to make the pull fail, then (if ``decode``) D0 with P's new params.

    Each case's conversation is its own (``tag`` in the first message), and turn 1's answer is long
    enough that P, which has turn 1's prompt cached, still lacks more than ``kv_recompute_threshold``
    (64) of the tokens D holds: the pull is not skipped."""
    turn1 = [{"role": "system", "content": f"{SYSTEM} ({tag})"}, MESSAGES[1]]
    turn2 = [*turn1, {"role": "assistant", "content": ""}, {"role": "user", "content": USER2}]
    t1 = d_chat("decode", stream=False, ids=True, name="t1_decode", p_step="t1_prefill", messages=turn1)
    t1["body"]["max_tokens"] = 96
    steps = [p_chat("t1_prefill", turn1), t1]
    p2 = p_chat("t2_prefill", turn2)
    p2["bind"] = [
        {"to": ["messages", 2, "content"], "from": "t1_decode", "take": ["json", "choices", 0, "message", "content"]},
        {"to": ["kv_transfer_params"], "from": "t1_decode", "take": ["json", "kv_transfer_params"], "edit": edit},
    ]
    steps.append(p2)
    if decode:
        d2 = d_chat("decode", stream=False, ids=True, name="t2_decode", p_step="t2_prefill", messages=turn2)
        d2["bind"].append(p2["bind"][0])
        steps.append(d2)
    return steps


def get(name: str, path: str, engine: str = "prefill") -> dict[str, Any]:
    return {"name": name, "engine": engine, "method": "GET", "path": path, "body": None}


def cases() -> list[dict[str, Any]]:
    """Every case: (group, name, description, steps, replay hints)."""
    bad = {"model": M, "messages": "not a list"}
    c: list[tuple[str, str, str, list[dict[str, Any]], dict[str, Any] | None]] = [
        ("main", "models", "GET /v1/models", [get("models", "/v1/models")], None),
        ("main", "version", "GET /version", [get("version", "/version")], None),
        ("main", "health", "GET /health", [get("health", "/health")], None),
        (
            "main",
            "tokenize_messages",
            "POST /tokenize with chat messages (chat template applied)",
            [
                {
                    "name": "tokenize",
                    "engine": "prefill",
                    "path": "/tokenize",
                    "body": {"model": M, "messages": MESSAGES},
                }
            ],
            None,
        ),
        (
            "main",
            "tokenize_detokenize",
            "POST /tokenize with a prompt, then /detokenize of its ids",
            [
                {"name": "tokenize", "engine": "prefill", "path": "/tokenize", "body": {"model": M, "prompt": USER}},
                {
                    "name": "detokenize",
                    "engine": "prefill",
                    "path": "/detokenize",
                    "body": {"model": M, "tokens": None},
                    "bind": [{"to": ["tokens"], "from": "tokenize", "take": ["json", "tokens"]}],
                },
            ],
            None,
        ),
        ("main", "render_chat", "POST /v1/chat/completions/render", [render_step()], None),
        (
            "main",
            "pd_chat_json",
            "P chat (max_tokens 1, do_remote_decode), then D non-streaming with "
            "return_token_ids: D's body carries its own handle (bidirectional)",
            [p_chat(), d_chat("decode", stream=False, ids=True)],
            None,
        ),
        (
            "main",
            "pd_chat_json_plain",
            "P chat, then D non-streaming without return_token_ids (vLLM's toy proxy)",
            [p_chat(), d_chat("decode", stream=False)],
            None,
        ),
        (
            "main",
            "pd_completions_ids_json",
            "render, P /v1/completions with the token ids (as turnkv on 0.26), then D /v1/completions non-streaming",
            [render_step(), p_completions(), d_completions("decode", stream=False)],
            None,
        ),
        (
            "main",
            "pd_chat_stream",
            "P chat, then D streaming, no options",
            [p_chat(), d_chat("decode", stream=True)],
            None,
        ),
        (
            "main",
            "pd_chat_stream_ids_usage",
            "P chat, then D streaming with return_token_ids and include_usage",
            [p_chat(), d_chat("decode", stream=True, ids=True, usage=True)],
            None,
        ),
        (
            "main",
            "pd_chat_stream_continuous_usage",
            "P chat, then D streaming with continuous usage stats",
            [p_chat(), d_chat("decode", stream=True, usage=True, continuous=True)],
            None,
        ),
        (
            "main",
            "pd_completions_stream",
            "render, P completions with ids, D completions streaming with return_token_ids and include_usage",
            [render_step(), p_completions(), d_completions("decode", stream=True)],
            None,
        ),
        (
            "main",
            "plugin_chat_stream_ids_usage",
            "as pd_chat_stream_ids_usage, D with the turnkv plugin",
            [p_chat(), d_chat("decode_plugin", stream=True, ids=True, usage=True)],
            PLUGIN_REPLAY,
        ),
        (
            "main",
            "plugin_chat_stream",
            "as pd_chat_stream, D with the turnkv plugin",
            [p_chat(), d_chat("decode_plugin", stream=True)],
            PLUGIN_REPLAY,
        ),
        (
            "main",
            "plugin_completions_stream",
            "as pd_completions_stream, D with the turnkv plugin",
            [render_step(), p_completions(), d_completions("decode_plugin", stream=True)],
            PLUGIN_REPLAY,
        ),
        (
            "main",
            "plugin_chat_json",
            "P chat, then D with the plugin, non-streaming (unchanged by the plugin)",
            [p_chat(), d_chat("decode_plugin", stream=False, ids=True)],
            PLUGIN_REPLAY,
        ),
        (
            "main",
            "next_turn_pull",
            "turn 1 through P and D; turn 2's P request carries D's handle (P pulls "
            "D's blocks), then D with P's params",
            second_turn("next turn", None, decode=True),
            None,
        ),
        (
            "main",
            "error_validation_400",
            "messages is not a list: 400",
            [{"name": "chat", "engine": "prefill", "path": "/v1/chat/completions", "body": bad}],
            None,
        ),
        (
            "main",
            "error_max_tokens_400",
            "max_tokens above max_model_len: 400",
            [
                {
                    "name": "chat",
                    "engine": "prefill",
                    "path": "/v1/chat/completions",
                    "body": {"model": M, "messages": MESSAGES, "max_tokens": 100000},
                }
            ],
            None,
        ),
        (
            "main",
            "error_context_400",
            "a 100-token prompt with max_tokens = max_model_len - 50: 400",
            [
                {
                    "name": "completions",
                    "engine": "prefill",
                    "path": "/v1/completions",
                    "body": {"model": M, "prompt": [100] * 100, "max_tokens": 32768 - 50},
                }
            ],
            None,
        ),
        (
            "main",
            "error_model_404",
            "unknown model: 404",
            [
                {
                    "name": "chat",
                    "engine": "prefill",
                    "path": "/v1/chat/completions",
                    "body": {"model": "no-such-model", "messages": MESSAGES, "max_tokens": 4},
                }
            ],
            None,
        ),
        (
            "main",
            "error_model_404_stream",
            "unknown model with stream: a JSON 404, not a stream",
            [
                {
                    "name": "chat",
                    "engine": "decode",
                    "path": "/v1/chat/completions",
                    "body": {"model": "no-such-model", "messages": MESSAGES, "max_tokens": 4, "stream": True},
                }
            ],
            None,
        ),
        ("main", "metrics", "GET /metrics of D after the flows above", [get("metrics", "/metrics", "decode")], None),
        (
            "pull_failures",
            "expired_handle_500",
            "turn 2's P request with D's handle whose remote_blocks_expiry_time was moved an hour back: "
            "P declines the read, the KV load fails (policy fail): 500",
            second_turn("expired", {"shift": {"remote_blocks_expiry_time": -3600.0}}, decode=False),
            None,
        ),
        (
            "pull_failures",
            "refused_pull_engine_id_500",
            "turn 2's P request with D's handle naming another engine "
            "id: the NIXL handshake refuses it, the KV load fails: 500",
            second_turn("refused", {"set": {"remote_engine_id": FAKE_ENGINE_ID}}, decode=False),
            None,
        ),
    ]
    out = []
    for seq, (group, name, desc, steps, replay) in enumerate(c):
        case: dict[str, Any] = {
            "format": protocol.FORMAT,
            "case": name,
            "seq": seq,
            "group": group,
            "description": desc,
            "steps": steps,
        }
        if replay:
            case["replay"] = replay
        out.append(case)
    return out


def record(case: dict[str, Any], urls: dict[str, str], source: dict[str, Any]) -> dict[str, Any]:
    results = protocol.run_steps(case, urls)
    for step in case["steps"]:
        step["sent_body"] = protocol.resolve_body(step, results)
        step["response"] = results[step["name"]]
    case["source"] = source
    return case


def plugin_check(recorded: dict[str, dict[str, Any]], urls: dict[str, str]) -> dict[str, Any]:
    """What D1 (plugin) sent against D0 (none) and against vLLM 0.33's rules; every item must be true."""
    from_plugin = devlib.get(urls["decode_plugin"], "/version")
    from_plain = devlib.get(urls["decode"], "/version")
    checks: dict[str, Any] = {
        "header_on_plugin_engine": from_plugin.headers.get("x-turnkv-plugin"),
        "header_absent_without_plugin": "x-turnkv-plugin" not in from_plain.headers,
    }
    json_kv = None
    base = recorded.get("pd_chat_json")
    if base:
        json_kv = base["steps"][-1]["response"]["json"].get("kv_transfer_params")
        checks["d0_json_handle_keys"] = sorted(json_kv) if isinstance(json_kv, dict) else json_kv
    for name, kind in (
        ("plugin_chat_stream_ids_usage", "chat"),
        ("plugin_chat_stream", "chat"),
        ("plugin_completions_stream", "completion"),
        ("pd_chat_stream_ids_usage", "chat"),
    ):
        case = recorded.get(name)
        if not case:
            continue
        resp = case["steps"][-1]["response"]
        events = [e for e in resp.get("events", []) if isinstance(e, dict)]
        finals = [e for e in events if any(c.get("finish_reason") for c in e.get("choices") or [])]
        with_output = [
            e
            for e in events
            if e.get("choices") and (kind == "completion" or any("token_ids" in c for c in e["choices"]))
        ]
        without_output = [e for e in events if e not in with_output]
        item: dict[str, Any] = {
            "stream_header": resp["headers"].get("x-turnkv-plugin"),
            "chunks": len(events),
            "finish_chunk_has_handle": bool(finals) and isinstance(finals[-1].get("kv_transfer_params"), dict),
            "token_chunks_null": all(
                e.get("kv_transfer_params", "absent") is None for e in with_output if e not in finals
            ),
            "others_without_key": all("kv_transfer_params" not in e for e in without_output),
            "key_is_last": all(list(e)[-1] == "kv_transfer_params" for e in with_output),
        }
        if finals and isinstance(finals[-1].get("kv_transfer_params"), dict):
            item["handle_keys_equal_json_handle"] = isinstance(json_kv, dict) and sorted(
                finals[-1]["kv_transfer_params"]
            ) == sorted(json_kv)
        if name.startswith("pd_"):  # D0: plain 0.26, no key anywhere
            item = {"no_key_anywhere_without_plugin": all("kv_transfer_params" not in e for e in events)}
        checks[name] = item
    log_file = devlib.STATE_DIR / "logs" / "d1.log"
    lines = [ln for ln in devlib.tail(log_file, 100000).splitlines() if "turnkv plugin" in ln]
    checks["plugin_log_lines"] = lines[-8:]
    checks["plain_engine_log_lines"] = [
        ln for ln in devlib.tail(devlib.STATE_DIR / "logs" / "d0.log", 100000).splitlines() if "turnkv plugin" in ln
    ][-4:]
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", default="main", choices=["main", "pull_failures", "all"])
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--exclude", default="", help="comma-separated case-name prefixes to leave out")
    ap.add_argument("--no-start", action="store_true", help="use engines already running")
    ap.add_argument("--case-dir", type=Path, default=None, help="also write the case files here")
    a = ap.parse_args(argv)
    specs, note = engines.start_trio(start=not a.no_start)
    urls = {"prefill": specs[0].url, "decode": specs[1].url, "decode_plugin": specs[2].url}
    version = (devlib.get(urls["prefill"], "/version").json or {}).get("version", "unknown")
    source = {
        "kind": devlib.backend(),
        "version": version,
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engines": {
            r: {
                "port": s.port,
                "plugin": s.plugin,
                "flags": s.flags,
                "model": Path(s.model).name,
                "kv_transfer_config": devlib.kv_config(s),
            }
            for r, s in zip(("prefill", "decode", "decode_plugin"), specs, strict=True)
        },
        "sim_flags": SIM_FLAGS,
    }
    source["trio"] = note
    only = {x for x in a.only.split(",") if x}
    skip = tuple(x for x in a.exclude.split(",") if x)
    todo = [
        c
        for c in cases()
        if (a.group == "all" or c["group"] == a.group)
        and (not only or c["case"] in only)
        and not (skip and c["case"].startswith(skip))
    ]
    work = devlib.STATE_DIR / f"fixtures-{a.group}"
    recorded: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    for case in todo:
        if not note.get("plugin_engine", True) and any(s["engine"] == "decode_plugin" for s in case["steps"]):
            failures.append(f"{case['case']}: not recorded, the plugin engine did not start")
            continue
        t0 = time.perf_counter()
        try:
            recorded[case["case"]] = record(case, urls, source)
        except (OSError, KeyError, TypeError, IndexError) as exc:
            failures.append(f"{case['case']}: {type(exc).__name__}: {exc}")
            devlib.log(f"FAILED {case['case']}: {exc}")
            continue
        statuses = [s["response"]["status"] for s in case["steps"]]
        devlib.log(f"{case['case']}: {statuses} ({time.perf_counter() - t0:.2f} s)")
        protocol.write_case(work, case)
        if a.case_dir:
            protocol.write_case(a.case_dir, case)
    out = devlib.out_dir()
    with tarfile.open(out / f"fixtures-{a.group}.tgz", "w:gz") as tar:
        tar.add(work, arcname=version if devlib.backend() == "vllm" else f"sim-{version}")
    summary: dict[str, Any] = {"version": version, "recorded": sorted(recorded), "failures": failures}
    summary["trio"] = note
    if a.group in ("main", "all") and note.get("plugin_engine", True):
        summary["plugin_check"] = plugin_check(recorded, urls)
    devlib.write_json(out / f"fixtures-{a.group}.json", summary)
    print(json.dumps(summary, indent=1)[:6000])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
