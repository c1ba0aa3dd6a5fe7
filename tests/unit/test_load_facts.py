"""The engines' load as the policy is told it (``reuse.load``): vLLM's metrics read twice, the gateway's own
prefills in flight, the facts derived from them, and what is left to the policy's model when a metric is
missing. Fleet snapshots in, facts out; then the decision those facts change."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from turnkv.engine.base import Histo
from turnkv.engine.vllm.info import load_sample
from turnkv.gateway.fleet import Fleet
from turnkv.gateway.turn.plan import facts
from turnkv.reuse.cost import Action, CostParams, TurnFacts
from turnkv.reuse.load import decode_context, load_facts, mean_between, prefill_queue
from turnkv.reuse.policies import build_policy
from turnkv.routing import InstanceView

P, D = "http://p0", "http://d0"
FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm" / "0.26.0" / "metrics.json"

LATENCY = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",num_gpu_blocks="1000",engine=""}} 1.0
# TYPE {itl} histogram
{itl}_count{{engine="0",model_name="m"}} {itl_n}
{itl}_sum{{engine="0",model_name="m"}} {itl_s}
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {q_n}
vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {q_s}
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} {pf_n}
vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {pf_s}
"""


def metrics(
    *,
    running: int = 0,
    waiting: int = 0,
    usage: float = 0.0,
    itl: str = "vllm:inter_token_latency_seconds",
    itl_n: float = 0,
    itl_s: float = 0.0,
    q_n: float = 0,
    q_s: float = 0.0,
    pf_n: float = 0,
    pf_s: float = 0.0,
) -> str:
    return LATENCY.format(
        running=running,
        waiting=waiting,
        usage=usage,
        itl=itl,
        itl_n=itl_n,
        itl_s=itl_s,
        q_n=q_n,
        q_s=q_s,
        pf_n=pf_n,
        pf_s=pf_s,
    )


def read(f: Fleet, url: str, text: str) -> InstanceView:
    sample = load_sample(text)
    assert sample is not None
    f.apply_load(url, sample)
    v = f.view(url)
    assert v is not None
    return v


def test_real_vllm_metrics_carry_the_three_latency_histograms() -> None:
    doc = json.loads(FIXTURE.read_text())
    sample = load_sample(doc["steps"][0]["response"]["raw"])  # vLLM 0.26.0's /metrics, recorded
    assert sample is not None and sample.itl is not None
    assert sample.prefill_time is not None and sample.prefill_time.count == 9.0
    assert sample.prefill_time.sum == pytest.approx(0.21141681299997117)
    assert sample.queue_time is not None and sample.queue_time.count == 9.0
    assert sample.itl.count > 0 and sample.itl.sum > 0


def test_the_older_name_of_the_inter_token_histogram_is_read_too() -> None:
    sample = load_sample(metrics(itl="vllm:time_per_output_token_seconds", itl_n=4, itl_s=0.1))
    assert sample is not None and sample.itl == Histo(0.1, 4)


@pytest.mark.parametrize(
    ("prev", "cur", "mean"),
    [
        (Histo(1.0, 10), Histo(1.5, 30), 0.025),  # 20 gaps, 0.5 s in all
        (Histo(1.0, 10), Histo(1.0, 10), None),  # nothing observed between the reads
        (Histo(5.0, 100), Histo(0.2, 8), None),  # totals went back: the engine restarted
        (None, Histo(1.0, 10), None),  # one read is not enough
    ],
)
def test_a_histogram_read_twice_gives_the_mean_between_the_reads(
    prev: Histo | None, cur: Histo, mean: float | None
) -> None:
    assert mean_between(prev, cur) == (pytest.approx(mean) if mean is not None else None)


def test_ds_step_time_is_its_streams_mean_gap_since_the_last_read() -> None:
    f = Fleet([P], [D])
    first = read(f, D, metrics(running=8, itl_n=1000, itl_s=15.0))
    assert first.step_ms is None and load_facts(None, first, 0.0).sources["decode_step_ms"] == (
        "model:no_tokens_since_last_scrape"
    )
    v = read(f, D, metrics(running=8, itl_n=1400, itl_s=23.0))  # 400 gaps in 8 s: 20 ms a step
    lf = load_facts(None, v, 0.0)
    assert lf.decode_step_ms == pytest.approx(20.0) and lf.sources["decode_step_ms"] == "itl_histogram"
    v = read(f, D, metrics(running=0, itl_n=1400, itl_s=23.0))  # idle since: no step to tell
    assert load_facts(None, v, 0.0).decode_step_ms is None


def test_a_decode_engine_without_the_histogram_leaves_the_step_to_the_model() -> None:
    f = Fleet([P], [D])
    before = f.view(D)
    assert load_facts(None, before, 0.0).sources["decode_step_ms"] == "model:not_scraped"
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n"
    read(f, D, text)
    v = read(f, D, text)
    lf = load_facts(f.view(P), v, 0.0)
    assert lf.decode_step_ms is None and lf.sources["decode_step_ms"] == "model:no_itl_metric"
    assert lf.decode_context_tokens is None and lf.sources["decode_context_tokens"] == "model:no_kv_capacity"
    assert set(lf.fallbacks) == {"decode_step_ms", "decode_context_tokens"}


def test_ds_context_is_its_kv_in_use_less_what_the_gateway_pins_there() -> None:
    f = Fleet([P], [D])
    v = read(f, D, metrics(usage=0.5))  # 1000 blocks of 16: 8000 tokens in use
    assert decode_context(v) == (8000, "kv_usage")
    f.pinned(D, 3000, None)
    v2 = read(f, D, metrics(usage=0.5))  # of which the gateway's handles pin 3000
    assert decode_context(v2) == (5000, "kv_usage")


def test_ds_context_counts_the_gateways_streams_as_they_are_now() -> None:
    # at the read our stream's 2000 tokens of context were in D's 8000; it has ended since (its blocks are
    # not read by any stream now), and another of ours with 1500 runs there
    f = Fleet([P], [D])
    ended = f.hold(D, kv_tokens=2000)
    read(f, D, metrics(usage=0.5))
    ended.release()
    f.hold(D, kv_tokens=1500)
    v = f.view(D)
    assert v is not None and decode_context(v) == (7500, "kv_usage")


def test_ps_queue_is_the_gateways_prefills_in_flight_there_less_what_p_has_done_since() -> None:
    f = Fleet([P], [D])
    a = f.hold(P, work_s=0.25, tokens=8000)
    b = f.hold(P, work_s=0.05, tokens=300)
    f.hold(D)  # a decode request: no prefill work
    v = f.view(P)
    assert v is not None and (v.in_flight, v.queued_prefill_tokens) == (2, 8300)
    queue, source = prefill_queue(v, v.queued_since)
    assert queue == pytest.approx(300.0) and source == "gateway"
    assert prefill_queue(v, v.queued_since + 0.1)[0] == pytest.approx(200.0)  # P has been at it for 100 ms
    assert prefill_queue(v, v.queued_since + 5.0)[0] == 0.0  # estimates run out: no negative queue
    a.release()
    b.release()
    b.release()  # given back once
    idle = f.view(P)
    assert idle is not None and (idle.in_flight, prefill_queue(idle, 0.0)[0]) == (0, 0.0)


def test_a_prefills_served_time_leaves_out_its_wait_behind_the_gateways_earlier_ones() -> None:
    # the prefill estimator learns from these: a call's own wall time counts P's queue in (a saturated P
    # taught it 74x its compute per token)
    now = [0.0]
    f = Fleet([P], [D], clock=lambda: now[0])
    a = f.hold(P, work_s=0.25, tokens=8000)
    b = f.hold(P, work_s=0.05, tokens=300)  # sent at once: it waits behind a
    d = f.hold(D)  # no estimated work: nothing served is said of it
    now[0] = 0.25
    a.release()
    now[0] = 0.31
    b.release()
    d.release()
    assert a.served_s == pytest.approx(0.25) and b.served_s == pytest.approx(0.06) and d.served_s is None
    now[0] = 1.0  # P idle since 0.31: all of c's time is its own
    c = f.hold(P, work_s=0.1, tokens=2000)
    now[0] = 1.12
    c.release()
    assert c.served_s == pytest.approx(0.12)
    # out of order (a short one sent later ends first): each counts from the last end, and together they
    # add up to the busy spell
    e1, e2 = f.hold(P, work_s=0.3, tokens=9000), f.hold(P, work_s=0.01, tokens=100)
    now[0] = 1.15
    e2.release()
    now[0] = 1.45
    e1.release()
    assert e2.served_s == pytest.approx(0.03) and e1.served_s == pytest.approx(0.30)


def test_ps_other_requests_count_at_its_recent_prefill_time() -> None:
    f = Fleet([P], [D])
    read(f, P, metrics(pf_n=10, pf_s=1.0))
    held = f.hold(P, work_s=0.1, tokens=500)  # one of the four P counts next is this gateway's
    read(f, P, metrics(running=1, waiting=3, pf_n=14, pf_s=2.0))  # 4 prefills of 250 ms since the last read
    v = f.view(P)
    assert v is not None
    queue, source = prefill_queue(v, v.queued_since)
    assert queue == pytest.approx(100.0 + 3 * 250.0) and source == "gateway+prefill_time_histogram"
    held.release()
    f2 = Fleet([P], [D])
    bare = read(f2, P, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3\n")
    assert prefill_queue(bare, 0.0) == (0.0, "gateway:others_unknown")


def test_ps_counts_as_old_as_its_last_read_do_not_count_this_gateways_finished_prefills_as_others() -> None:
    f = Fleet([P], [D])
    read(f, P, metrics(pf_n=10, pf_s=1.0))
    slots = [f.hold(P, work_s=0.05, tokens=300) for _ in range(3)]
    read(f, P, metrics(running=3, pf_n=14, pf_s=2.0))  # P runs our three
    for s in slots:
        s.release()  # done since; P's counts say 3 until the next read
    v = f.view(P)
    assert v is not None and prefill_queue(v, 0.0) == (0.0, "gateway")


def test_the_prefills_waiting_at_p_are_the_gateways_in_flight_and_ps_others() -> None:
    f = Fleet([P], [D])
    assert load_facts(f.view(P), f.view(D), 0.0).prefill_waiting == 0  # P idle, its metrics not read yet
    ours = [f.hold(P, work_s=0.2, tokens=8000) for _ in range(2)]
    f.hold(D, local_prefill=300)  # a decode-local turn: not at P
    assert load_facts(f.view(P), f.view(D), 0.0).prefill_waiting == 2
    read(f, P, metrics(running=3, waiting=2))  # ours are two of its five
    assert load_facts(f.view(P), f.view(D), 0.0).prefill_waiting == 5
    for s in ours:
        s.release()
    # P's counts are as old as their read: the three others stand until the next one
    facts_now = load_facts(f.view(P), f.view(D), 0.0)
    assert facts_now.prefill_waiting == 3 and facts_now.log()["prefill_waiting"] == 3


def test_the_planners_facts_carry_the_load_and_leave_what_is_missing_to_the_model() -> None:
    clock = [100.0]
    f = Fleet([P], [D], clock=lambda: clock[0])
    read(f, D, metrics(running=4, usage=0.25, itl_n=100, itl_s=1.0))
    read(f, D, metrics(running=4, usage=0.25, itl_n=300, itl_s=4.0))  # 15 ms a step
    f.hold(P, work_s=0.4, tokens=16000)
    clock[0] += 0.1  # P has been at it for 100 ms of its 400
    p, d = f.view(P), f.view(D)
    assert p is not None and d is not None
    load = load_facts(p, d, f.now())
    tf = facts(
        None,
        prompt_tokens=1000,
        matched=0,
        prefill=p,
        decode=d,
        decode_holds=False,
        block_size=16,
        load=load,
    )
    assert tf.decode_step_ms == pytest.approx(15.0) and tf.decode_context_tokens == 4000
    assert tf.prefill_queue_ms == pytest.approx(300.0)
    none = load_facts(None, None, f.now())
    bare = facts(
        None,
        prompt_tokens=1000,
        matched=0,
        prefill=None,
        decode=None,
        decode_holds=False,
        block_size=16,
        load=none,
    )
    assert (bare.decode_step_ms, bare.decode_context_tokens, bare.prefill_queue_ms) == (None, None, None)


# -- the decision the queue changes ---------------------------------------------------------------

COSTS = CostParams(link_bytes_per_s=20e9, push_bytes_per_s=300e9, decode_chunk_tokens=64)


def later_turn(queue_ms: float | None, *, step_ms: float = 12.0, running: int = 8) -> TurnFacts:
    """A later turn of an 8k-token conversation: 328 new tokens, D holding the rest in its cache and P
    holding the last prompt, D running ``running`` streams at ``step_ms`` a step."""
    return TurnFacts(
        prompt_tokens=8656,
        reusable_tokens=8328,
        prefill_cached_tokens=8320,
        decode_cached_tokens=8320,
        decode_local_possible=True,
        decode_busy=running,
        decode_running=running,
        decode_context_tokens=running * 8500,
        decode_step_ms=step_ms,
        prefill_queue_ms=queue_ms,
    )


def test_a_long_queue_at_p_makes_decode_local_win_within_ds_itl_budget() -> None:
    policy = build_policy("adaptive", {"itl_budget_ms": 30.0, "decode_chunk_tokens": 16})
    idle = policy.decide(later_turn(0.0), COSTS)
    assert idle.action is not Action.DECODE_LOCAL  # at an idle P, P's path is faster than D's thin chunks
    queued = policy.decide(later_turn(800.0), COSTS)
    assert (queued.action, queued.reason and queued.reason.value) == (Action.DECODE_LOCAL, "decode_local")
    # the same queue, but D's steps already past the budget: P's path, and the budget says why
    over = policy.decide(later_turn(800.0, step_ms=31.0), COSTS)
    assert over.action is not Action.DECODE_LOCAL and over.reason is not None and over.reason.value == "itl_budget"


@pytest.mark.parametrize(
    ("setting", "p_gpus", "d_gpus", "expect"),
    [
        ("auto", {"GPU-a"}, {"GPU-a"}, (True, "engines")),
        ("auto", {"GPU-a", "GPU-b"}, {"GPU-b", "GPU-c"}, (True, "engines")),  # tensor-parallel, one GPU in common
        ("auto", {"GPU-a"}, {"GPU-b"}, (False, "engines")),
        ("auto", {"MIG-1"}, {"MIG-2"}, (False, "engines")),  # two MIG instances of one GPU: compute apart
        ("auto", set(), {"GPU-a"}, (False, "auto:gpus_unknown")),  # P does not say (no plugin there)
        ("auto", {"GPU-a"}, set(), (False, "auto:gpus_unknown")),
        (True, set(), set(), (True, "setting")),  # the operator's word stands, whatever the engines say
        (False, {"GPU-a"}, {"GPU-a"}, (False, "setting")),
    ],
)
def test_p_and_d_share_a_gpu_where_they_name_one_in_common_or_the_setting_says_so(
    setting: bool | str, p_gpus: set[str], d_gpus: set[str], expect: tuple[bool, str]
) -> None:
    f = Fleet([P], [D])
    p, d = f.view(P), f.view(D)
    assert p is not None and d is not None
    p, d = replace(p, gpus=frozenset(p_gpus)), replace(d, gpus=frozenset(d_gpus))
    lf = load_facts(p, d, 0.0, gpu_setting=setting)  # type: ignore[arg-type]
    assert (lf.shared_gpu, lf.sources["shared_gpu"]) == expect
    assert (
        facts(
            None, prompt_tokens=100, matched=0, prefill=p, decode=d, decode_holds=False, block_size=16, load=lf
        ).shared_gpu
        is expect[0]
    )
    assert load_facts(None, d, 0.0).sources["shared_gpu"] == "auto:no_engine"
