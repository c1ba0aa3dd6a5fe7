"""The doctor's judgements, verdict by verdict, from observations built by hand (no engine)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from turnkv.config import Settings
from turnkv.doctor.checks import Context, Observed
from turnkv.doctor.checks import engines as engine_checks
from turnkv.doctor.checks import memory as memory_checks
from turnkv.doctor.checks import template as template_checks
from turnkv.doctor.checks import transfer as transfer_checks
from turnkv.doctor.facts import EngineFacts, HostFacts, PullOutcome, Sample, SizeRun, TemplateFacts, TransferFacts
from turnkv.doctor.findings import Finding, Item, Verdict, exit_status
from turnkv.engine.base import ModelCard
from turnkv.engine.diagnostics import Advice, EngineDescription, LogFacts, TransferSettings
from turnkv.gateway.app import cost_priors
from turnkv.reuse.assess import TemplateClass

P, D, R = "http://127.0.0.1:8100", "http://127.0.0.1:8200", "http://127.0.0.1:8300"
BPT = 147456


def describe(**over: Any) -> EngineDescription:
    base: dict[str, Any] = {
        "version": "0.26.0",
        "plugin": None,
        "gpus": frozenset(),
        "models": (ModelCard("m", 40960),),
        "block_size": 16,
        "num_blocks": 20000,
        "prefix_caching": True,
        "memory_share": 0.42,
        "tokenizer": True,
        "tokenizer_detail": "has its tokenizer",
        "takes_prompt_ids": False,
        "stream_handles": True,
        "transfer": None,
    }
    return EngineDescription(**{**base, **over})


def engine(url: str, role: str, log: LogFacts | None = None, **over: Any) -> EngineFacts:
    return EngineFacts(url, role, describe(**over), log=log, local=True)


def run(n: int, fixed_s: float = 0.002, bw: float = 45e9) -> SizeRun:
    s = Sample(n, n * BPT, fixed_s + n * BPT / bw, 1)
    return SizeRun(n, prefill_s=0.003 + 25e-6 * n + 1.2e-9 * n * n / 2, push=s, pull=s, pull_call_s=0.01)


def transfer(**over: Any) -> TransferFacts:
    base: dict[str, Any] = {
        "prefill": P,
        "decode": D,
        "block_size": 16,
        "runs": tuple(run(n) for n in (2048, 8192, 32768)),
        "p_hands_off": True,
        "d_handle": True,
        "pull": PullOutcome.DONE,
        "p_endpoint": "127.0.0.1:5600",
        "d_endpoint": "127.0.0.1:5601",
    }
    return TransferFacts(**{**base, **over})


def observed(
    p: EngineFacts | None = None,
    d: EngineFacts | None = None,
    *,
    t: TransferFacts | None = None,
    template: TemplateFacts | None = None,
    render: EngineFacts | None = None,
) -> Observed:
    return Observed(
        prefill=(p or engine(P, "prefill"),),
        decode=(d or engine(D, "decode"),),
        render=render,
        template=template or TemplateFacts(P, False, TemplateClass.PRESERVES, "extends"),
        transfer=t if t is not None else transfer(),
        host=HostFacts(),
    )


def context(**settings: Any) -> Context:
    s = Settings(prefill=[P], decode=[D], **settings)
    return Context(settings=s, advice=lambda a: f"<{a.value}>")


def judge(obs: Observed, ctx: Context | None = None) -> list[Finding]:
    ctx = ctx or context()
    figures = transfer_checks.figures(obs.transfer, cost_priors(ctx.settings), ctx, 40960) if obs.transfer else None
    return (
        engine_checks.check(obs, ctx)
        + template_checks.check(obs, ctx)
        + transfer_checks.check(obs, ctx, figures)
        + memory_checks.check(obs, ctx)
    )


def about(findings: list[Finding], item: Item, engine: str | None = None) -> list[Finding]:
    return [f for f in findings if f.item is item and (engine is None or f.engine == engine)]


def verdicts(findings: list[Finding], item: Item, engine: str | None = None) -> set[Verdict]:
    return {f.verdict for f in about(findings, item, engine)}


def test_a_sound_pair_has_no_blocking_problem() -> None:
    found = judge(observed())
    assert exit_status(found) == 0, [f for f in found if f.verdict is Verdict.FAIL]
    assert verdicts(found, Item.BIDIRECTIONAL) == {Verdict.OK}
    assert verdicts(found, Item.PULL_PAYS) == {Verdict.OK}
    assert about(found, Item.PULL_PAYS)[0].data["break_even_tokens"] < 2048


def test_an_engine_that_does_not_answer_blocks() -> None:
    found = judge(observed(d=EngineFacts(D, "decode", None), t=transfer(runs=())))
    assert verdicts(found, Item.REACHABLE, D) == {Verdict.FAIL}
    assert exit_status(found) == 1


def test_engines_of_different_models_block() -> None:
    found = judge(observed(d=engine(D, "decode", models=(ModelCard("other", 40960),))))
    assert verdicts(found, Item.MODELS) == {Verdict.FAIL}
    assert "different models" in about(found, Item.MODELS)[0].summary


def test_a_models_setting_the_engines_do_not_serve_blocks() -> None:
    found = judge(observed(), context(models=["elsewhere"]))
    assert verdicts(found, Item.MODELS) == {Verdict.FAIL}


def test_different_context_lengths_warn() -> None:
    found = judge(observed(d=engine(D, "decode", models=(ModelCard("m", 8192),))))
    assert verdicts(found, Item.MODELS) == {Verdict.WARN}


def test_different_versions_warn_with_the_engines_fix() -> None:
    found = judge(observed(d=engine(D, "decode", version="0.27.1")))
    [f] = about(found, Item.VERSIONS)
    assert (f.verdict, f.fix) == (Verdict.WARN, f"<{Advice.VERSIONS_DIFFER.value}>")


def test_a_gateway_block_size_other_than_the_engines_blocks() -> None:
    found = judge(observed(), context(block_size=64))
    [f] = about(found, Item.BLOCK_SIZE)
    assert f.verdict is Verdict.FAIL and f.fix is not None and "block_size: 16" in f.fix


def test_engines_of_different_block_sizes_block() -> None:
    assert verdicts(judge(observed(d=engine(D, "decode", block_size=64))), Item.BLOCK_SIZE) == {Verdict.FAIL}


def test_a_prefill_engine_without_a_connector_blocks() -> None:
    found = judge(observed(t=transfer(p_hands_off=False, d_handle=None, runs=(), pull=PullOutcome.NOT_TRIED)))
    assert Verdict.FAIL in verdicts(found, Item.CONNECTOR)
    assert about(found, Item.CONNECTOR)[0].fix == f"<{Advice.NO_CONNECTOR.value}>"


def test_a_connector_the_config_says_is_missing_blocks() -> None:
    p = engine(P, "prefill", transfer=TransferSettings(connector=""))
    assert verdicts(judge(observed(p=p)), Item.CONNECTOR, P) == {Verdict.FAIL}


def test_d_that_cannot_read_p_blocks() -> None:
    found = judge(observed(t=transfer(push_failed="D counted no transfer", runs=(), d_handle=None)))
    assert Verdict.FAIL in verdicts(found, Item.CONNECTOR)


def test_bidirectional_off_on_d_blocks() -> None:
    found = judge(observed(t=transfer(d_handle=False, pull=PullOutcome.NOT_TRIED)))
    [f] = about(found, Item.BIDIRECTIONAL, D)
    assert f.verdict is Verdict.FAIL and f.fix == f"<{Advice.BIDIRECTIONAL_OFF_D.value}>"
    # nothing could be pulled: whether P has it on cannot be told
    assert verdicts(found, Item.BIDIRECTIONAL, P) == {Verdict.WARN}
    assert exit_status(found) == 1


@pytest.mark.parametrize("outcome", [PullOutcome.STALLED, PullOutcome.REFUSED])
def test_bidirectional_off_on_p_blocks(outcome: PullOutcome) -> None:
    found = judge(observed(t=transfer(pull=outcome, pull_detail="P did not pull")))
    [f] = about(found, Item.BIDIRECTIONAL, P)
    assert f.verdict is Verdict.FAIL and f.fix == f"<{Advice.BIDIRECTIONAL_OFF_P.value}>"


def test_bidirectional_off_in_the_config_blocks_even_unprobed() -> None:
    d = engine(
        D, "decode", transfer=TransferSettings(connector="NixlConnector", role="kv_consumer", bidirectional=False)
    )
    found = judge(observed(d=d, t=transfer(d_handle=None, runs=(), pull=PullOutcome.NOT_TRIED)))
    assert verdicts(found, Item.BIDIRECTIONAL, D) == {Verdict.FAIL}


def test_the_log_line_says_bidirectional_is_on() -> None:
    p = engine(P, "prefill", log=LogFacts(settings={"bidirectional_kv_xfer": "true"}))
    found = judge(observed(p=p, t=transfer(d_handle=None, pull=PullOutcome.NOT_TRIED)))
    assert verdicts(found, Item.BIDIRECTIONAL, P) == {Verdict.OK}


def test_a_failed_pull_blocks() -> None:
    found = judge(observed(t=transfer(pull=PullOutcome.FAILED, pull_detail="handshake failed")))
    assert Verdict.FAIL in verdicts(found, Item.LINK_D_TO_P)


def test_d_without_a_tokenizer_blocks_p_without_one_does_not() -> None:
    d = engine(D, "decode", tokenizer=False, tokenizer_detail="no tokenizer")
    assert verdicts(judge(observed(d=d)), Item.TOKENIZER, D) == {Verdict.FAIL}
    p = engine(P, "prefill", tokenizer=False, tokenizer_detail="no tokenizer")
    assert verdicts(judge(observed(p=p)), Item.TOKENIZER, P) == {Verdict.INFO}


def test_a_decode_engine_without_handles_on_its_streams_warns() -> None:
    found = judge(observed(d=engine(D, "decode", stream_handles=None)))
    assert verdicts(found, Item.PLUGIN, D) == {Verdict.WARN}


@pytest.mark.parametrize(("setting", "verdict"), [(True, Verdict.OK), ("auto", Verdict.OK), (False, Verdict.WARN)])
def test_shared_gpus_against_the_setting(setting: Any, verdict: Verdict) -> None:
    p = engine(P, "prefill", gpus=frozenset({"GPU-0"}))
    d = engine(D, "decode", gpus=frozenset({"GPU-0"}))
    found = judge(observed(p=p, d=d), context(shared_gpu=setting))
    assert verdicts(found, Item.GPUS) == {verdict}


def test_gpus_not_said_is_information() -> None:
    assert verdicts(judge(observed()), Item.GPUS) == {Verdict.INFO}


def test_one_side_channel_address_for_both_warns() -> None:
    found = judge(observed(t=transfer(p_endpoint="localhost:5600", d_endpoint="localhost:5600")))
    assert verdicts(found, Item.SIDE_CHANNEL) == {Verdict.WARN}


def test_a_tokens_only_prefill_with_no_render_setting_blocks() -> None:
    # the gateway renders on P by default; P has no tokenizer, D does: set render to D
    p = engine(P, "prefill", tokenizer=False, tokenizer_detail="no tokenizer")
    found = judge(observed(p=p, template=TemplateFacts(P, False, None, "cannot render")))
    [f] = about(found, Item.RENDER)
    assert f.verdict is Verdict.FAIL and f.fix is not None and D in f.fix
    assert exit_status(found) == 1


def test_a_tokens_only_prefill_with_d_as_render_is_sound() -> None:
    p = engine(P, "prefill", tokenizer=False, tokenizer_detail="no tokenizer")
    found = judge(observed(p=p, template=TemplateFacts(D, True, TemplateClass.PRESERVES, "extends")), context(render=D))
    assert verdicts(found, Item.RENDER) == {Verdict.OK}
    assert exit_status(found) == 0


def test_d_rendering_other_ids_than_the_render_target_blocks() -> None:
    r = engine(R, "render")
    t = TemplateFacts(R, True, TemplateClass.PRESERVES, "extends", decode_agrees=False)
    found = judge(observed(template=t, render=r), context(render=R))
    assert Verdict.FAIL in verdicts(found, Item.TEMPLATE)


@pytest.mark.parametrize(
    ("cls", "policy", "verdict"),
    [
        (TemplateClass.PRESERVES, "adaptive", Verdict.OK),
        (TemplateClass.DROPS_REASONING, "adaptive", Verdict.WARN),
        (TemplateClass.REWRITES_HISTORY, "adaptive", Verdict.WARN),
        (TemplateClass.REWRITES_HISTORY, "vllm-multiturn", Verdict.FAIL),
        (TemplateClass.UNKNOWN, "adaptive", Verdict.WARN),
    ],
)
def test_the_template_class_against_the_policy(cls: TemplateClass, policy: str, verdict: Verdict) -> None:
    ctx = context(policy={"name": policy})
    ctx = replace(ctx, checks_tokens=policy != "vllm-multiturn")
    found = judge(observed(template=TemplateFacts(P, False, cls, "")), ctx)
    assert verdicts(found, Item.TEMPLATE) == {verdict}


def test_a_slow_link_warns_and_a_pull_never_pays() -> None:
    t = transfer(runs=tuple(run(n, bw=0.43e9) for n in (2048, 8192, 32768)))
    found = judge(observed(t=t))
    [push] = about(found, Item.LINK_P_TO_D)
    assert push.verdict is Verdict.WARN and "TCP" in push.summary
    [pays] = about(found, Item.PULL_PAYS)
    assert pays.verdict is Verdict.WARN and pays.data["break_even_tokens"] is None
    assert exit_status(found) == 0  # slow, not wrong


def test_the_measured_link_is_reported_with_its_fixed_cost() -> None:
    [f] = about(judge(observed()), Item.LINK_D_TO_P)
    assert f.verdict is Verdict.OK
    assert f.data["gbps"] == pytest.approx(45, rel=1e-3) and f.data["fixed_ms"] == pytest.approx(2, rel=1e-3)


def test_a_kv_bytes_setting_off_the_measurement_warns() -> None:
    assert verdicts(judge(observed()), Item.KV_BYTES) == {Verdict.OK}
    assert verdicts(judge(observed(), context(kv_bytes_per_token=57344)), Item.KV_BYTES) == {Verdict.WARN}


def test_decode_memory_says_how_many_conversations_fit() -> None:
    [f] = about(judge(observed()), Item.DECODE_MEMORY)
    # 320,000 tokens of KV, half of it for pins: 9 conversations of 16,384 tokens
    assert f.verdict is Verdict.OK and f.data["conversations"] == 9
    assert f.data["pressure_tokens"] == 288000


def test_decode_memory_for_few_conversations_warns() -> None:
    d = engine(D, "decode", num_blocks=2000)
    [f] = about(judge(observed(d=d)), Item.DECODE_MEMORY)
    assert f.verdict is Verdict.WARN and f.data["conversations"] == 0


def test_decode_memory_unknown_capacity_warns() -> None:
    d = engine(D, "decode", num_blocks=None)
    assert verdicts(judge(observed(d=d)), Item.DECODE_MEMORY) == {Verdict.WARN}


def test_a_gateway_that_keeps_handles_longer_than_d_blocks() -> None:
    settings = TransferSettings(connector="NixlConnector", role="kv_consumer", bidirectional=True, decoder_ttl_s=300)
    found = judge(observed(d=engine(D, "decode", transfer=settings)))
    ttl = [f for f in about(found, Item.DECODE_MEMORY) if "frees pinned blocks" in f.summary]
    assert [f.verdict for f in ttl] == [Verdict.FAIL]


def test_settings_an_engine_keeps_to_itself_are_listed_with_how_to_check() -> None:
    d = engine(D, "decode", unexposed=(("kv_lease_duration", "its config"),))
    [f] = about(judge(observed(d=d)), Item.UNEXPOSED)
    assert f.verdict is Verdict.INFO and "its config" in f.summary
