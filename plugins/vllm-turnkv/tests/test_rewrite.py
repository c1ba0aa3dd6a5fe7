"""The SSE rewriting against chunks as vLLM 0.26 writes them and as 0.33 would."""

from __future__ import annotations

import json

import pytest
from vllm_turnkv.middleware import header_value, parse_header_value
from vllm_turnkv.rewrite import dumps_params, rewrite_event

PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[4, 5, 6]],
    "remote_engine_id": "e-1",
    "remote_request_id": "chatcmpl-x-12345678",
    "remote_host": "localhost",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_num_tokens": 48,
    "remote_blocks_expiry_time": 18734.52,
}
HEAD = '"id":"chatcmpl-X","object":"chat.completion.chunk","created":1760000000,"model":"m"'
ROLE = (
    "data: {" + HEAD + ',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    '"finish_reason":null}],"prompt_token_ids":[1,2,3],"prompt_text":null}\n\n'
)
TOKEN = (
    "data: {" + HEAD + ',"choices":[{"index":0,"delta":{"content":"Héllo"},"logprobs":null,'
    '"finish_reason":null,"token_ids":[9707]}]}\n\n'
)
SUPPRESSED = (
    "data: {" + HEAD + ',"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
)
FINISH = (
    "data: {" + HEAD + ',"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop",'
    '"stop_reason":null,"token_ids":[151645]}],"system_fingerprint":"vllm-0.26.0-1a2b3c4d"}\n\n'
)
USAGE = (
    "data: {" + HEAD + ',"choices":[],"usage":{"prompt_tokens":37,"total_tokens":45,"completion_tokens":8},'
    '"system_fingerprint":"vllm-0.26.0-1a2b3c4d"}\n\n'
)
ERROR = 'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}\n\n'
DONE = "data: [DONE]\n\n"
CMPL = '"id":"cmpl-X","object":"text_completion","created":1760000000,"model":"m"'
CMPL_TOKEN = (
    "data: {" + CMPL + ',"choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null,'
    '"stop_reason":null,"prompt_token_ids":[1,2],"token_ids":[7]}]}\n\n'
)
CMPL_FINISH = (
    "data: {" + CMPL + ',"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length",'
    '"stop_reason":null,"token_ids":[8]}]}\n\n'
)
CMPL_USAGE = "data: {" + CMPL + ',"choices":[],"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2}}\n\n'


def payload(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[6:-2])


@pytest.mark.parametrize("event", [ROLE, USAGE, ERROR, DONE, "", "data: {}\n\n", "data: [1]\n\n", "event: x\n\n"])
def test_chat_events_without_output_are_unchanged(event: str) -> None:
    assert rewrite_event(event, "chat", PARAMS) == event


def test_token_chunks_get_null_as_last_key() -> None:
    for event in (TOKEN, SUPPRESSED):
        out = rewrite_event(event, "chat", PARAMS)
        obj = payload(out)
        assert list(obj)[-1] == "kv_transfer_params" and obj["kv_transfer_params"] is None
        # the original bytes are kept, the key is appended before the closing brace
        assert out == event[:-3] + ',"kv_transfer_params":null}\n\n'


def test_finish_chunk_gets_the_params() -> None:
    out = rewrite_event(FINISH, "chat", PARAMS)
    obj = payload(out)
    assert obj["kv_transfer_params"] == PARAMS
    assert list(obj) == ["id", "object", "created", "model", "choices", "system_fingerprint", "kv_transfer_params"]
    assert out.endswith('"remote_blocks_expiry_time":18734.52}}\n\n')


def test_finish_chunk_without_params_gets_null() -> None:
    assert payload(rewrite_event(FINISH, "chat", None))["kv_transfer_params"] is None


def test_non_ascii_and_compact_bytes_are_kept() -> None:
    out = rewrite_event(TOKEN, "chat", PARAMS)
    assert "Héllo" in out and ": " not in out[len("data: ") :]


def test_a_chunk_that_already_has_the_key_is_left_alone() -> None:
    native = TOKEN[:-3] + ',"kv_transfer_params":null}\n\n'
    assert rewrite_event(native, "chat", PARAMS) == native


def test_completion_chunks() -> None:
    assert payload(rewrite_event(CMPL_TOKEN, "completion", PARAMS))["kv_transfer_params"] is None
    assert payload(rewrite_event(CMPL_FINISH, "completion", PARAMS))["kv_transfer_params"] == PARAMS
    assert rewrite_event(CMPL_USAGE, "completion", PARAMS) == CMPL_USAGE


def test_chat_rule_differs_from_completions_rule() -> None:
    # a choice without token_ids is a chat role/echo chunk, but any completions chunk with choices has output
    role_like = "data: {" + CMPL + ',"choices":[{"index":0,"text":"x","logprobs":null,"finish_reason":null}]}\n\n'
    assert rewrite_event(role_like, "chat", PARAMS) == role_like
    assert "kv_transfer_params" in payload(rewrite_event(role_like, "completion", PARAMS))


def test_params_written_like_pydantic() -> None:
    assert dumps_params(None) == "null"
    assert dumps_params({"a": [1, 2], "b": "é", "c": 1.5}) == '{"a":[1,2],"b":"é","c":1.5}'


def test_header_value_round_trip() -> None:
    v = header_value("0.1.0", ["chat", "completions"])
    assert v == "0.1.0; streams=chat,completions"
    assert parse_header_value(v) == ("0.1.0", frozenset({"chat", "completions"}), frozenset())
    assert parse_header_value(None) is None and parse_header_value("") is None
    assert parse_header_value("0.2.0") == ("0.2.0", frozenset(), frozenset())
