"""The shape comparison catches what it must, and ignores what varies from run to run."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.compat import protocol
from turnkv import launch

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "0.26.0"


def rec_json(obj: Any, status: int = 200) -> dict[str, Any]:
    raw = json.dumps(obj, separators=(",", ":"))
    return protocol.record_response(status, {"content-type": "application/json"}, raw)


def rec_sse(events: list[Any]) -> dict[str, Any]:
    raw = "".join(f"data: {e if isinstance(e, str) else json.dumps(e, separators=(',', ':'))}\n\n" for e in events)
    return protocol.record_response(200, {"content-type": "text/event-stream; charset=utf-8"}, raw)


BODY: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "choices": [{"index": 0, "token_ids": [1, 2]}],
    "kv_transfer_params": {"remote_block_ids": [[1, 2]], "remote_blocks_expiry_time": 12.5, "tp_size": 1},
}


def test_values_that_vary_are_ignored() -> None:
    other = copy.deepcopy(BODY)
    other["id"], other["created"] = "chatcmpl-2", 99
    other["choices"][0]["token_ids"] = [7, 8, 9, 10]
    other["kv_transfer_params"]["remote_block_ids"] = [[5]]
    other["kv_transfer_params"]["remote_blocks_expiry_time"] = 99.25
    assert protocol.compare_response(rec_json(BODY), rec_json(other)) == []


@pytest.mark.parametrize(
    ("mutate", "expect"),
    [
        (lambda b: b.pop("created"), "keys missing ['created']"),
        (lambda b: b.update(extra=None), "extra ['extra']"),
        (lambda b: b["kv_transfer_params"].update(remote_blocks_expiry_time=None), "type float (recorded) != null"),
        (lambda b: b["kv_transfer_params"].update(remote_blocks_expiry_time=12), "type float (recorded) != int"),
        (lambda b: b.update(object="chat.completion.chunk"), "'chat.completion' (recorded) != 'chat.completion.chunk'"),
        (lambda b: b["choices"][0].update(token_ids=["a"]), "$.choices[0].token_ids"),
    ],
)
def test_shape_differences_are_reported(mutate: Any, expect: str) -> None:
    other = copy.deepcopy(BODY)
    mutate(other)
    problems = protocol.compare_response(rec_json(BODY), rec_json(other))
    assert any(expect in p for p in problems), problems


def test_key_order_matters() -> None:
    other = dict(reversed(list(BODY.items())))
    assert any("key order" in p for p in protocol.compare_response(rec_json(BODY), rec_json(other)))


def test_status_content_type_and_compactness() -> None:
    assert protocol.compare_response(rec_json(BODY), rec_json(BODY, 500))[0].startswith("status 200")
    spaced = protocol.record_response(200, {"content-type": "application/json"}, json.dumps(BODY))
    assert any("compact" in p for p in protocol.compare_response(rec_json(BODY), spaced))
    text = protocol.record_response(200, {"content-type": "text/plain"}, "x")
    assert any("header content-type" in p for p in protocol.compare_response(rec_json(BODY), text))


ROLE = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
TOKEN = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": None}]}
FINISH = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length", "token_ids": None}]}


def test_streams_compare_collapsed_chunk_kinds() -> None:
    a = rec_sse([ROLE, TOKEN, TOKEN, FINISH, "[DONE]"])
    b = rec_sse([ROLE, TOKEN, TOKEN, TOKEN, TOKEN, FINISH, "[DONE]"])
    assert protocol.compare_response(a, b) == []
    no_role = rec_sse([TOKEN, FINISH, "[DONE]"])
    assert any("chunk kinds differ" in p for p in protocol.compare_response(a, no_role))
    with_key = rec_sse([ROLE, {**TOKEN, "kv_transfer_params": None}, FINISH, "[DONE]"])
    assert any("extra ['kv_transfer_params']" in p for p in protocol.compare_response(a, with_key))
    assert protocol.compare_response(with_key, a, drop_stream_keys=("kv_transfer_params",)) == []


def test_sse_framing() -> None:
    good = rec_sse([ROLE, FINISH, "[DONE]"])
    assert protocol.sse_framing(good["raw"]) == []
    bad = protocol.record_response(
        200,
        {"content-type": "text/event-stream"},
        good["raw"].replace("data: [DONE]\n\n", "event: end\ndata: [DONE]\n\n"),
    )
    assert any("SSE framing" in p for p in protocol.compare_response(good, bad))


def test_bindings_and_edits() -> None:
    results = {"d": {"json": {"kv_transfer_params": {"remote_blocks_expiry_time": 100.0, "remote_engine_id": "e"}}}}
    step = {
        "body": {"kv_transfer_params": None},
        "bind": [
            {
                "to": ["kv_transfer_params"],
                "from": "d",
                "take": ["json", "kv_transfer_params"],
                "edit": {"shift": {"remote_blocks_expiry_time": -3600.0}, "set": {"remote_engine_id": "x"}},
            }
        ],
    }
    body = protocol.resolve_body(step, results)
    assert body == {"kv_transfer_params": {"remote_blocks_expiry_time": -3500.0, "remote_engine_id": "x"}}
    assert results["d"]["json"]["kv_transfer_params"]["remote_engine_id"] == "e"  # the source is not changed


def test_a_simulator_of_another_version_is_told_apart(procs: list[launch.Running], tmp_path: Path) -> None:
    """0.26 recordings replayed against a 0.33 simulator: the 0.33 stream additions are found."""
    cases = {c["case"]: c for c in protocol.load_cases(RECORDED)}
    case = cases["pd_chat_stream_ids_usage"]
    flags = [f if f != "0.26" else "0.33" for f in case["source"]["sim_flags"]]
    procs.append(launch.sim("p33", "prefill", *flags, log_dir=tmp_path))
    procs.append(launch.sim("d33", "decode", *flags, log_dir=tmp_path))
    results = protocol.run_steps(case, {"prefill": procs[0].url, "decode": procs[1].url}, timeout_s=30)
    problems = protocol.compare_response(case["steps"][-1]["response"], results["decode"])
    assert any("kv_transfer_params" in p for p in problems), problems
