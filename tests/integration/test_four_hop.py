"""Four hops through the gateway (``engine: vllm-four-hop``): a simulated render service, tokens-only P and D,
and derender; every answer is the colocated engine's, multi-turn reuse works as on two hops, and a reuse the
template forbids is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.cluster import (
    Cluster,
    Dialogue,
    Turn,
    ask,
    metric,
    sim_control,
    sim_state,
    start_cluster,
    wait_for,
)
from turnkv import launch

pytestmark = pytest.mark.integration


def four_hop_cluster(
    procs: list[launch.Running],
    log_dir: Path,
    *,
    compat: str = "0.26",
    plugin: bool = True,
    template: str = "keep",
    policy: str = "always-pull",
    gateway_env: dict[str, str] | None = None,
    decode_flags: tuple[str, ...] = (),
    sim_flags: tuple[str, ...] = (),
) -> tuple[Cluster, launch.Running]:
    common = ("--time-scale", "0", "--template", template, "--vllm-compat", compat)
    render = launch.sim("render", "render", *common, log_dir=log_dir)
    procs.append(render)
    cluster = start_cluster(
        procs,
        log_dir,
        template=template,
        compat=compat,
        policy=policy,
        sim_flags=sim_flags,
        prefill_flags=("--tokens-only",),
        decode_flags=("--tokens-only", *(("--turnkv-plugin",) if plugin else ()), *decode_flags),
        gateway_env={"TURNKV_ENGINE": "vllm-four-hop", "TURNKV_RENDER": render.url, **(gateway_env or {})},
    )
    return cluster, render


def conversation(cluster: Cluster, n: int, *, stream: bool, tools: bool = False) -> list[Turn]:
    """``n`` turns, each answer checked against the colocated engine's non-streamed one: a streamed four-hop
    answer adds up to what vLLM's non-streaming derender says (blank content before a tool call is none)."""
    turns = []
    with Dialogue(cluster, stream=stream, tools=tools) as d:
        for i in range(n):
            truth, _, _ = ask(d.truth, d.messages, stream=False, session=None, tools=tools, max_tokens=d.max_tokens)
            turn = d.step(truth=False)
            assert turn.answer == truth, (i, turn.answer, truth)
            turns.append(turn)
    return turns


@pytest.mark.parametrize(
    ("compat", "stream", "tools"), [("0.26", False, True), ("0.26", True, True), ("0.33", True, False)]
)
def test_every_answer_is_the_colocated_one_and_later_turns_pull(
    procs: list[launch.Running], tmp_path: Path, compat: str, stream: bool, tools: bool
) -> None:
    cluster, render = four_hop_cluster(procs, tmp_path, compat=compat)
    # the gateway's template audit at start renders too (a probe conversation through the render service)
    wait_for(lambda: "template.audit" in (tmp_path / "gateway.log").read_text(), what="the template audit")
    before = sim_state(render.url)["calls"]
    turns = conversation(cluster, 5, stream=stream, tools=tools)
    assert turns[0].reason == "no_record"
    assert [t.outcome for t in turns[1:]] == ["full"] * 4, [(t.outcome, t.reason) for t in turns]
    assert all(t.headers["x-turnkv-action"] == "pull" for t in turns[1:])
    assert [e["capture"] for e in cluster.turn_events(5)] == ["stored"] * 5
    pulled = metric(cluster.prefill[0].url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert pulled > 0  # P really loaded KV from D
    calls = sim_state(render.url)["calls"]
    assert calls["render"] - before.get("render", 0) == 5  # each turn rendered once
    assert calls["derender"] == 5  # one non-streaming derender an answer


def test_without_the_plugin_streamed_turns_store_no_handle(procs: list[launch.Running], tmp_path: Path) -> None:
    cluster, _ = four_hop_cluster(procs, tmp_path, plugin=False)
    turns = conversation(cluster, 3, stream=True)
    assert [t.reason for t in turns] == ["no_record", "no_handle_in_stream", "no_handle_in_stream"]


def test_a_template_that_drops_reasoning_is_refused(procs: list[launch.Running], tmp_path: Path) -> None:
    cluster, _ = four_hop_cluster(procs, tmp_path, template="strip")
    turns = conversation(cluster, 3, stream=False)
    assert all(t.reason != "full_match" for t in turns[1:]), [(t.outcome, t.reason) for t in turns]


def test_stop_strings_are_refused_before_any_hop(procs: list[launch.Running], tmp_path: Path) -> None:
    cluster, render = four_hop_cluster(procs, tmp_path)
    wait_for(lambda: "template.audit" in (tmp_path / "gateway.log").read_text(), what="the template audit")
    before = sim_state(render.url)["calls"]
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "Hi"}], "stop": ["."], "max_tokens": 20}
    r = httpx.post(cluster.gateway.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer k"})
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["param"] == "stop" and "stop strings are not supported on four hops" in err["message"]
    assert sim_state(render.url)["calls"] == before  # refused before any hop


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
def test_the_responses_api_over_four_hops(procs: list[launch.Running], tmp_path: Path, compat: str) -> None:
    """Streamed and not, chained by previous_response_id or sent whole: the colocated engine's answers, D's KV
    reused from the second turn."""
    from tests.integration.test_zero_config import INSTRUCTIONS, _as_compared, _respond, _truth_answer
    from turnkv.gateway.responses.translate import input_messages

    cluster, _ = four_hop_cluster(procs, tmp_path, compat=compat)
    client = cluster.client()
    history: list[Any] = [{"role": "user", "content": "Plan a short trip."}]
    new_items = list(history)
    previous: str | None = None
    for turn in range(5):
        chained = previous is not None and turn % 3 != 2
        r, headers = _respond(
            client,
            turn % 2 == 1,
            input=new_items if chained else history,
            **({"previous_response_id": previous} if chained else {}),
        )
        truth = _truth_answer(cluster, [{"role": "system", "content": INSTRUCTIONS}, *input_messages(history)])
        assert [_as_compared(m) for m in input_messages([o.model_dump() for o in r.output])] == [truth]
        if turn > 0:
            assert headers["x-turnkv-outcome"] == "full", headers
        calls = [o for o in r.output if o.type == "function_call"]
        new_items = [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"result {turn}"} for c in calls
        ] or [{"role": "user", "content": f"And step {turn}?"}]
        history = [*history, *[o.model_dump(exclude_none=True) for o in r.output], *new_items]
        previous = r.id


def test_the_four_hop_demo_matches_colocated(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "turnkv", "demo", "--four-hop", "--turns", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "over four hops" in proc.stdout and "Every answer matched the colocated engine." in proc.stdout
    assert proc.stdout.count("full/pull") >= 2


def post_chat(cluster: Cluster, **body: Any) -> httpx.Response:
    req = {"model": "sim-model", "messages": [{"role": "user", "content": "Plan a trip"}], "max_tokens": 60, **body}
    return httpx.post(cluster.gateway.url + "/v1/chat/completions", json=req, timeout=60)


def test_errors_on_the_four_hop_path_reach_the_client_in_openai_shape(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    cluster, render = four_hop_cluster(procs, tmp_path)
    # the render service refuses the request: its reason, as a 400
    r = post_chat(cluster, continue_final_message=True, add_generation_prompt=True)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )
    # a render service that fails once: asked once more (as a failed P is), and the client has its answer
    sim_control(render.url, fail_render_next=1)
    assert post_chat(cluster).status_code == 200
    # one that keeps failing: an error status (with a second replica, the call goes there instead)
    sim_control(render.url, fail_render_next=10)
    r = post_chat(cluster)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_status", r.text
    sim_control(render.url, fail_render_next=0)
    # derender fails: not streamed, an error status; streamed, an error event after the role chunk, then [DONE]
    sim_control(render.url, fail_derender_next=1)
    r = post_chat(cluster)
    assert r.status_code >= 500 and set(r.json()["error"]) >= {"message", "type", "code"}, r.text
    assert post_chat(cluster).status_code == 200  # and the gateway goes on serving


def test_a_derender_failing_after_text_was_streamed_ends_the_stream_with_an_error_event(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    slow_d = ("--time-scale", "1", "--decode-itl-ms", "5")  # text reaches the client before D finishes
    cluster, render = four_hop_cluster(procs, tmp_path, decode_flags=slow_d)
    sim_control(render.url, fail_derender_next=1)
    r = post_chat(cluster, stream=True, max_tokens=200)
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and '"content"' in r.text
    assert events[-1] == "data: [DONE]" and events[-2].startswith('data: {"error"'), r.text[-500:]
    assert post_chat(cluster, stream=True).status_code == 200  # and the gateway goes on serving


def test_usage_counts_render_s_prompt_and_the_cached_tokens(procs: list[launch.Running], tmp_path: Path) -> None:
    # vLLM says cached tokens only with --enable-prompt-tokens-details
    cluster, render = four_hop_cluster(procs, tmp_path, sim_flags=("--enable-prompt-tokens-details",))
    headers = {"X-Session-ID": "usage-1"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Plan a trip"}]
    usages = []
    for stream in (False, True):
        body = {"model": "sim-model", "messages": messages, "max_tokens": 40, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = httpx.post(cluster.gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
            usage = events[-1]["usage"]
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        else:
            usage = r.json()["usage"]
            content = r.json()["choices"][0]["message"]["content"]
        ids = httpx.post(render.url + "/v1/chat/completions/render", json={"model": "sim-model", "messages": messages})
        assert usage["prompt_tokens"] == len(ids.json()["token_ids"])
        usages.append(usage)
        messages = [*messages, {"role": "assistant", "content": content}, {"role": "user", "content": "And then?"}]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0  # turn 2 pulled D's KV
    assert usages[1]["completion_tokens"] > 0
