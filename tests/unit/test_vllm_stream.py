"""Reading D's answer: SSE framing, what the client sees, and what is captured for the next turn."""

from __future__ import annotations

import json
import random
import re

import pytest

from turnkv.engine.vllm.stream import DecodeCapture, VllmDecodeStream
from turnkv.openai.sse import SSESplitter, frame


def _some(payload: bytes | None) -> bytes:
    assert payload is not None, "the chunk is forwarded"
    return payload


ROLE = (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    b'"prompt_token_ids":[1,2,3],"prompt_text":null}'
)
TOKEN = (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null,"token_ids":[7]}],'
    b'"kv_transfer_params":null}'
)
THINK = (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"reasoning":"hm"},"logprobs":null,"finish_reason":null,"token_ids":[5,6]}]}'
)
FINAL = (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},'
    b'"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":[2]}],'
    b'"kv_transfer_params":{"do_remote_decode":true,"remote_num_tokens":6}}'
)


@pytest.mark.parametrize("cut", [1, 5, 17, 100, 250])
def test_splitter_reassembles_events_across_reads(cut: int) -> None:
    stream = frame(ROLE) + frame(TOKEN) + b"data: [DONE]\n\n"
    s = SSESplitter()
    out: list[bytes] = []
    for i in range(0, len(stream), cut):
        out += s.feed(stream[i : i + cut])
    assert out == [ROLE, TOKEN, b"[DONE]"]
    assert not s.pending


def test_splitter_accepts_crlf_and_multiline_data() -> None:
    s = SSESplitter()
    assert s.feed(b"data: a\r\ndata: b\r\n\r\n: comment\n\n") == [b"a\nb"]


def test_capture_collects_and_hides_what_turnkv_added() -> None:
    cap = DecodeCapture(keep_token_ids=False)
    outs = [cap.chunk(p) for p in (ROLE, THINK, TOKEN, FINAL)]
    assert cap.prompt_token_ids == [1, 2, 3]
    assert cap.token_ids == [5, 6, 7, 2]
    assert cap.kv_transfer_params == {"do_remote_decode": True, "remote_num_tokens": 6}
    assert cap.finish_reason == "stop"
    assert [visible for _, visible in outs] == [False, True, True, True]
    seen = [json.loads(_some(b)) for b, _ in outs]
    assert seen[0]["prompt_token_ids"] is None
    assert all(c["choices"][0].get("token_ids") is None for c in seen[1:])
    assert seen[3]["kv_transfer_params"] is None
    answer, reasoning = cap.answer.digests()
    assert reasoning is not None


def test_capture_keeps_ids_the_client_asked_for() -> None:
    cap = DecodeCapture(keep_token_ids=True)
    out, _ = cap.chunk(TOKEN)
    assert out == TOKEN  # nothing to change: forwarded byte for byte
    out, _ = cap.chunk(FINAL)
    assert json.loads(_some(out))["choices"][0]["token_ids"] == [2]
    assert json.loads(_some(out))["kv_transfer_params"] is None


def test_error_event_is_recorded_and_forwarded() -> None:
    cap = DecodeCapture(keep_token_ids=False)
    payload = b'{"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}'
    out, visible = cap.chunk(payload)
    assert (out, visible) == (payload, False)
    assert cap.error is not None and cap.error["code"] == 500


def test_non_streaming_body() -> None:
    cap = DecodeCapture(keep_token_ids=False)
    body = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x", "reasoning": "r"},
                "finish_reason": "length",
                "token_ids": [4, 5],
            }
        ],
        "prompt_token_ids": [1],
        "kv_transfer_params": {"remote_num_tokens": 2},
    }
    out = cap.body(body)
    assert (cap.prompt_token_ids, cap.token_ids, cap.finish_reason) == ([1], [4, 5], "length")
    assert cap.kv_transfer_params == {"remote_num_tokens": 2}
    assert out["kv_transfer_params"] is None and out["prompt_token_ids"] is None
    assert out["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("payload", [ROLE, THINK, TOKEN, FINAL])
def test_a_stateless_turn_sees_what_a_collecting_one_sees(payload: bytes) -> None:
    """The byte-level fast path agrees with the parsed path on what matters for relaying."""
    fast, full = DecodeCapture(keep_token_ids=True, collect=False), DecodeCapture(keep_token_ids=True)
    (out_fast, vis_fast), (out_full, vis_full) = fast.chunk(payload), full.chunk(payload)
    assert vis_fast == vis_full
    assert json.loads(_some(out_fast)) == json.loads(_some(out_full))
    assert fast.finish_reason == full.finish_reason


def test_stateless_turns_still_never_see_a_handle() -> None:
    out, _ = DecodeCapture(keep_token_ids=True, collect=False).chunk(FINAL)
    assert json.loads(_some(out))["kv_transfer_params"] is None


# vLLM writes compact JSON; another server might not. Either way the ids are captured and hidden.
SPACED = b'{"choices": [{"index": 0, "delta": {"content": ""}}], "prompt_token_ids": [1, 2, 3]}'
# a first chunk that also ends the answer and carries the handle
ONE_CHUNK = (
    b'{"id":"c","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"length","token_ids":[9]}],'
    b'"prompt_token_ids":[1,2,3],"kv_transfer_params":{"do_remote_decode":true,"remote_num_tokens":4}}'
)


@pytest.mark.parametrize(
    ("payload", "keep"),
    [(ROLE, False), (ROLE, True), (SPACED, False), (SPACED, True), (ONE_CHUNK, False), (ONE_CHUNK, True)],
)
def test_prompt_ids_are_captured_and_shown_only_when_asked(payload: bytes, keep: bool) -> None:
    cap = DecodeCapture(keep_token_ids=keep)
    out, _ = cap.chunk(payload)
    assert json.loads(_some(out))["prompt_token_ids"] == ([1, 2, 3] if keep else None)
    assert cap.prompt_token_ids == [1, 2, 3]
    assert "kv_transfer_params" not in json.loads(_some(out)) or json.loads(_some(out))["kv_transfer_params"] is None


# a completion's chunk carries the prompt's ids in its choice, not at the top level
COMPLETION = (
    b'{"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","prompt_token_ids":[1,2,3],'
    b'"token_ids":[9],"finish_reason":"length"}],"kv_transfer_params":{"do_remote_decode":true}}'
)
SPACED_IDS = b'{"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [9]}], "prompt_token_ids":[1,2,3]}'


def test_a_completion_keeps_its_ids_where_they_were() -> None:
    out, _ = DecodeCapture(keep_token_ids=True).chunk(COMPLETION)
    seen = json.loads(_some(out))
    assert seen["choices"][0]["prompt_token_ids"] == [1, 2, 3] and "prompt_token_ids" not in seen
    assert seen["kv_transfer_params"] is None


@pytest.mark.parametrize("keep", [False, True])
def test_generated_ids_in_spaced_json_are_hidden_unless_asked(keep: bool) -> None:
    cap = DecodeCapture(keep_token_ids=keep)
    seen = json.loads(_some(cap.chunk(SPACED_IDS)[0]))
    assert seen["choices"][0]["token_ids"] == ([9] if keep else None)
    assert seen["prompt_token_ids"] == ([1, 2, 3] if keep else None)
    assert (cap.token_ids, cap.prompt_token_ids) == ([9], [1, 2, 3])


IDS_ONLY = (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[9]}]}'
)
USAGE = (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":40,"total_tokens":45,"completion_tokens":5,'
    b'"prompt_tokens_details":{"cached_tokens":40}}}'
)


@pytest.mark.parametrize(("keep", "forwarded", "visible"), [(False, False, False), (True, True, True)])
def test_a_chunk_of_token_ids_alone_is_only_forwarded_to_who_asked(keep: bool, forwarded: bool, visible: bool) -> None:
    # D sends an empty delta to carry the ids of a token that shows no text; plain vLLM would not have
    # sent it, and it is no first token (a failure after it can still be rerun unseen)
    cap = DecodeCapture(keep_token_ids=keep)
    out, shown = cap.chunk(IDS_ONLY)
    assert (out is not None, shown) == (forwarded, visible)
    assert cap.token_ids == [9]


@pytest.mark.parametrize(("cached", "seen"), [(None, 40), (12, 12), (100, 40)])
def test_usage_says_what_this_turn_did_not_compute(cached: int | None, seen: int) -> None:
    cap = DecodeCapture(keep_token_ids=False, collect=False, cached_tokens=cached)
    out, _ = cap.chunk(USAGE)
    assert out is not None
    assert json.loads(_some(out))["usage"]["prompt_tokens_details"]["cached_tokens"] == seen


# logprobs as vLLM writes them: Python's json would write -1e-05 and 0.1 back (orjson 1e-05 as -0.00001)
LOGPROBS_FINAL = (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":'
    b'{"content":"\xc3\xa9"},"logprobs":{"content":[{"token":"x","logprob":-0.00001,"bytes":[120],'
    b'"top_logprobs":[]}]},"finish_reason":"stop","stop_reason":null,"token_ids":[2]}],'
    b'"usage":{"prompt_tokens":40,"total_tokens":45,"completion_tokens":5,"prompt_tokens_details":'
    b'{"cached_tokens":4}},"kv_transfer_params":{"do_remote_decode":true,"remote_block_ids":[[1,2]],'
    b'"remote_num_tokens":6,"remote_blocks_expiry_time":18734.52,"remote_host":"h"}}'
)


@pytest.mark.parametrize("collect", [True, False])
def test_a_chunk_is_changed_in_vllms_own_bytes_only_where_it_must(collect: bool) -> None:
    """The handle nulled, the ids nulled, cached_tokens corrected in the bytes vLLM sent: its floats and
    text reach the client as vLLM wrote them, not as an encoder writes them again."""
    cap = DecodeCapture(keep_token_ids=False, collect=collect, cached_tokens=3)
    out, shown = cap.chunk(LOGPROBS_FINAL)
    expected = (
        LOGPROBS_FINAL.replace(b'"token_ids":[2]', b'"token_ids":null')
        .replace(b'"cached_tokens":4}', b'"cached_tokens":3}')
        .split(b',"kv_transfer_params":')[0]
        + b',"kv_transfer_params":null}'
    )
    assert out == expected and shown
    assert cap.kv_transfer_params is not None and cap.kv_transfer_params["remote_blocks_expiry_time"] == 18734.52
    assert cap.finish_reason == "stop" and cap.token_ids == [2]


def test_a_chunk_that_cannot_be_changed_in_its_bytes_is_encoded_again() -> None:
    spaced = FINAL.replace(b'"remote_num_tokens":6', b'"remote_num_tokens": 6')  # not as compact JSON writes it
    cap = DecodeCapture(keep_token_ids=False)
    out, _ = cap.chunk(spaced)
    seen = json.loads(_some(out))
    assert seen["kv_transfer_params"] is None and seen["choices"][0]["token_ids"] is None
    assert cap.kv_transfer_params == {"do_remote_decode": True, "remote_num_tokens": 6}
    # a cached_tokens value found twice is not guessed at either
    twice = USAGE.replace(b'"completion_tokens":5', b'"completion_tokens":5,"x":{"cached_tokens":40}')
    out, _ = DecodeCapture(keep_token_ids=False, cached_tokens=7).chunk(twice)
    assert json.loads(_some(out))["usage"]["prompt_tokens_details"]["cached_tokens"] == 7


class _PlainSplitter:
    """The reference: split the whole text at the first event end, again and again."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        out: list[bytes] = []
        while True:
            i, j = self.buf.find(b"\n\n"), self.buf.find(b"\r\n\r\n")
            if i < 0 and j < 0:
                return out
            if j >= 0 and (i < 0 or j < i):
                event, self.buf = self.buf[:j], self.buf[j + 4 :]
            else:
                event, self.buf = self.buf[:i], self.buf[i + 2 :]
            lines = [ln[5:].lstrip(b" ") for ln in event.splitlines() if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))


@pytest.mark.parametrize("seed", range(40))
def test_splitter_agrees_with_the_plain_reading_on_mixed_streams(seed: int) -> None:
    rng = random.Random(seed)
    parts = [b"data: a", b"data:b", b"data:  c", b"\n", b"\r\n", b"\n\n", b"\r\n\r\n", b": note", b"\r", b"x"]
    stream = b"".join(rng.choice(parts) for _ in range(200))
    ours, ref = SSESplitter(), _PlainSplitter()
    got: list[bytes] = []
    want: list[bytes] = []
    i = 0
    while i < len(stream):
        n = rng.randint(1, 40)
        got += ours.feed(stream[i : i + n])
        want += ref.feed(stream[i : i + n])
        i += n
    assert got == want and ours.pending == bool(ref.buf.strip())


class _Content:
    """aiohttp's response content, as ``VllmDecodeStream`` reads it: the reads D's bytes arrived in."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def readany(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""


class _Response:
    def __init__(self, reads: list[bytes]) -> None:
        self.content = _Content(reads)


USAGE_CHUNK = b'{"id":"c","choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}'
ERROR = b'{"error":{"message":"boom","code":500}}'
FINISH = b'{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}],"kv_transfer_params":null}'
EVENTS = [frame(TOKEN)] * 6 + [frame(THINK), frame(ROLE), frame(FINAL), frame(FINISH), frame(USAGE_CHUNK), frame(ERROR)]
ODD = [b": keep-alive\n\n", b'data: {"a":\r\n\r\n', b"data: x\ndata: y\n\n", b"data: [DONE]\n\n"]


async def _relayed(reads: list[bytes], cached: int | None, relayed: bool) -> tuple[bytes, DecodeCapture]:
    cap = DecodeCapture(keep_token_ids=False, collect=False, cached_tokens=cached)
    stream = VllmDecodeStream(_Response(list(reads)), cap)  # type: ignore[arg-type]
    out = []
    while True:
        if relayed:
            got = await stream.read_relayed()
            if got is None:
                break
            out.append(got)
        else:  # the base class's way: every event parsed and framed again
            pieces = await stream.read()
            if pieces is None:
                break
            out += [frame(body) for body, _, _ in pieces if body is not None]
    return b"".join(out), cap


@pytest.mark.parametrize("seed", range(30))
async def test_a_stateless_answer_relayed_unsplit_is_the_answer_relayed_event_by_event(seed: int) -> None:
    """The oracle is the parsed path: whatever reads D's bytes come in, what the client gets holds the same
    events (the handle nulled, the usage corrected, the error and the finish noted), whichever reads went
    through unsplit."""
    rng = random.Random(seed)
    stream = b"".join(rng.choice(EVENTS + ODD[:3]) for _ in range(30)) + ODD[3]
    cuts = sorted(rng.sample(range(1, len(stream)), 12)) if seed % 3 else []  # some reads end mid-event
    events_only = [e for e in re.split(b"(?<=\n\n)", stream) if e]  # or whole events per read, as vLLM sends
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)] if cuts else events_only
    cached = rng.choice([None, 0, 2])
    fast, fast_cap = await _relayed(reads, cached, relayed=True)
    slow, slow_cap = await _relayed(reads, cached, relayed=False)
    assert SSESplitter().feed(fast) == SSESplitter().feed(slow)
    assert (fast_cap.finish_reason, fast_cap.error) == (slow_cap.finish_reason, slow_cap.error)
    assert b'"kv_transfer_params":{' not in fast


async def test_a_read_of_token_events_goes_through_as_d_sent_it() -> None:
    read = frame(TOKEN) * 3
    out, _ = await _relayed([read, frame(FINAL), b"data: [DONE]\n\n"], None, relayed=True)
    assert out.startswith(read)  # unchanged bytes: nothing was nulled or re-framed


@pytest.mark.parametrize(
    "read",
    [
        frame(FINAL),  # the finish and the handle
        frame(FINISH),
        frame(ERROR),
        frame(USAGE_CHUNK),  # the count to correct (cached is set)
        b"data: [DONE]\n\n",
        b": keep-alive\n\n" + frame(TOKEN),  # not a data line
        b"data: x\ndata: y\n\n",  # an event of two lines
        frame(TOKEN).replace(b"\n\n", b"\r\n\r\n"),
        frame(TOKEN)[:-1],  # an event cut in two
    ],
)
def test_a_read_with_anything_to_change_or_note_is_parsed(read: bytes) -> None:
    assert not DecodeCapture(keep_token_ids=False, collect=False, cached_tokens=0).as_is(read)
    assert DecodeCapture(keep_token_ids=False, collect=False, cached_tokens=0).as_is(frame(TOKEN) * 2)
    assert not DecodeCapture(keep_token_ids=False, collect=True).as_is(frame(TOKEN))  # a collecting turn
