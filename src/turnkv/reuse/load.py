"""What the engines' load means for one turn: D's step time now, the KV its running streams read each
step, how long the turn would wait at P before its prefill starts, and how long at D.

Pure: snapshots of the engines in (``InstanceView``, as the fleet last read them and as this gateway
holds them), ``LoadFacts`` out. Each fact says where it came from, or why it is missing; a missing fact
is left to the policy's own model (``reuse.cost``: D's step estimated from its batch, no queue at P).

Every count is of the moment of the decision: this gateway's own requests from its own bookkeeping now,
other clients' from the engine's last metrics with this gateway's requests of that moment taken out
(``InstanceView.others``, ``busy``, ``waiting_now``, ``kv_usage_now``). A request of this gateway that has
ended since, such as a conversation's previous turn when an agent sends the next one the instant the stream
ends, counts nowhere.

* ``decode_running``, ``decode_waiting``, ``decode_kv_usage``: D's streams running now, requests waiting
  there, and the share of its KV in use (``InstanceView.busy``, ``waiting_now``, ``kv_usage_now``). A
  stream's blocks stay pinned on D after it ends until its handle is released or written back: handles the
  gateway gave up on count in D's KV in use until then (``InstanceView.let_go_tokens``).

* ``decode_step_ms``: the mean gap between D's streams' tokens since the fleet's last read but one
  (``vllm:inter_token_latency_seconds``: the difference of its sum over the difference of its count
  between two reads), i.e. D's recent step time. Missing when D reports no such histogram, before two
  reads, or when no token came out between them.
* ``decode_context_tokens``: the KV D's running requests hold now: other clients', as
  ``vllm:kv_cache_usage_perc`` x its KV size (``vllm:cache_config_info``) said, less what this gateway's
  requests and stored handles held there then (pinned blocks are not read by any stream), and this
  gateway's requests' contexts now. Missing before D's KV size is known.
* ``prefill_queue_ms``: the prefills this gateway has in flight on P, each as the cost model estimated
  it when it was sent (new tokens over what P had cached), less what P has already worked since the
  oldest of them started (P takes them in order), plus P's other requests (running and waiting, as its
  metrics said, beyond this gateway's own in flight when they were read) at P's recent mean prefill time
  (``vllm:request_prefill_time_seconds``). Missing when there is no P; when P has requests of others
  and no prefill-time histogram, their part is left out and the source says so.
* ``prefill_waiting``: the prefills at P now: this gateway's in flight there, and P's other requests
  (running and waiting, as its metrics said, beyond this gateway's own in flight when they were read). The
  policy takes about as many turns to come to P behind a turn's prefill before P's queue drains.
* ``decode_prefills``: the decode-local turns this gateway has sent to D whose first token has not come
  (and their tokens): their prefill chunks share D's steps with a next decode-local turn's.
* ``decode_queue_ms``: how long a request sent to D now would wait to be scheduled there: 0 while no
  request of another client waited there at its last read; else the mean wait of the requests it scheduled between its
  last two reads (``vllm:request_queue_time_seconds``), at least one step; without that histogram, one
  step per waiting request (the source says so). Missing when there is no D or before its first read.
* ``shared_gpu``: P and D compute on the same GPU(s), so that P's prefills slow D's steps as D's own do:
  as the setting ``shared_gpu`` says, or with ``auto``, whether the two engines name a GPU in common
  (turnkv's vLLM plugin names the GPUs an engine computes on by NVML UUID); false where either does not
  say (the source says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # routing's scorers read P's queue from here
    from turnkv.engine.base import Histo
    from turnkv.routing.base import InstanceView


@dataclass(frozen=True)
class LoadFacts:
    decode_step_ms: float | None = None
    decode_context_tokens: int | None = None
    prefill_queue_ms: float | None = None
    decode_queue_ms: float | None = None
    decode_running: int = 0  # D's streams running now: this gateway's, and other clients' as last read
    decode_waiting: int = 0  # requests of other clients waiting on D, as last read
    decode_kv_usage: float = 0.0  # share of D's KV in use now
    prefill_waiting: int = 0  # prefills at P now: this gateway's in flight there, and P's others
    decode_prefills: int = 0  # this gateway's decode-local turns prefilling on D now (no first token yet)
    decode_prefill_tokens: int = 0  # ... the tokens they prefill, all together
    shared_gpu: bool = False  # P and D compute on the same GPU(s)
    # per fact: where its value came from, or "model:<why>" when the policy's model stands in for it
    sources: dict[str, str] = field(default_factory=dict)

    def log(self) -> dict[str, object]:
        """The facts as the turn log shows them."""
        return {
            "decode_step_ms": None if self.decode_step_ms is None else round(self.decode_step_ms, 2),
            "decode_context_tokens": self.decode_context_tokens,
            "prefill_queue_ms": None if self.prefill_queue_ms is None else round(self.prefill_queue_ms, 1),
            "decode_queue_ms": None if self.decode_queue_ms is None else round(self.decode_queue_ms, 1),
            "decode_running": self.decode_running,
            "decode_waiting": self.decode_waiting,
            "decode_kv_usage": round(self.decode_kv_usage, 4),
            "prefill_waiting": self.prefill_waiting,
            "decode_prefills": self.decode_prefills,
            "shared_gpu": self.shared_gpu,
            "sources": dict(self.sources),
        }

    @property
    def fallbacks(self) -> list[str]:
        """The facts left to the policy's model."""
        return [k for k, v in self.sources.items() if v.startswith("model:")]


def mean_between(prev: Histo | None, cur: Histo | None) -> float | None:
    """The mean of what a histogram observed between two readings; None when nothing was observed (or the
    engine restarted: its totals went back)."""
    if prev is None or cur is None or cur.count <= prev.count or cur.sum < prev.sum:
        return None
    return (cur.sum - prev.sum) / (cur.count - prev.count)


def decode_step(d: InstanceView | None) -> tuple[float | None, str]:
    if d is None:
        return None, "model:no_decode_engine"
    if d.step_ms is not None:
        return d.step_ms, "itl_histogram"
    if not d.scraped:
        return None, "model:not_scraped"
    if not d.latency_metrics:
        return None, "model:no_itl_metric"
    return None, "model:no_tokens_since_last_scrape"


def decode_context(d: InstanceView | None) -> tuple[int | None, str]:
    if d is None:
        return None, "model:no_decode_engine"
    if not d.scraped:
        return None, "model:not_scraped"
    others = d.others_kv_tokens
    if others is None:
        return None, "model:no_kv_capacity"
    return others + d.own_kv_tokens, "kv_usage"


def prefill_queue(p: InstanceView | None, now: float) -> tuple[float | None, str]:
    """(ms the next prefill would wait on ``p``, where that came from); ``now`` on the clock of
    ``InstanceView.queued_since`` (monotonic)."""
    if p is None:
        return None, "model:no_prefill_engine"
    own_s = p.queued_prefill_s
    if own_s > 0 and p.queued_since > 0:
        own_s = max(0.0, own_s - max(0.0, now - p.queued_since))  # P has been at it since the oldest started
    source = "gateway"
    others_ms = 0.0
    others = p.others
    if others and p.prefill_request_ms is not None:
        others_ms = others * p.prefill_request_ms
        source = "gateway+prefill_time_histogram"
    elif others:
        source = "gateway:others_unknown"
    return own_s * 1e3 + others_ms, source


def prefill_waiting(p: InstanceView | None) -> int:
    """The prefills at ``p`` now: this gateway's in flight there, and P's others (``InstanceView.others``)."""
    return 0 if p is None else p.queued_prefills + p.others


def decode_queue(d: InstanceView | None, default_step_ms: float) -> tuple[float | None, str]:
    """(ms a request sent to ``d`` now would wait before D schedules it, where that came from);
    ``default_step_ms``: D's step where it measured none (the cost model's)."""
    if d is None:
        return None, "model:no_decode_engine"
    if not d.scraped:
        return None, "model:not_scraped"
    waiting = d.waiting_now
    if waiting <= 0:
        return 0.0, "waiting_gauge"
    step = d.step_ms if d.step_ms is not None else default_step_ms
    if d.queue_wait_ms is not None:
        return max(d.queue_wait_ms, step), "queue_time_histogram"
    return waiting * step, "model:waiting_x_step"


def shared_gpu(setting: bool | Literal["auto"], p: InstanceView | None, d: InstanceView | None) -> tuple[bool, str]:
    """(whether ``p`` and ``d`` compute on the same GPU, where that came from): the setting where it says
    true or false; with ``auto``, whether they name a GPU in common."""
    if setting != "auto":
        return bool(setting), "setting"
    if p is None or d is None:
        return False, "auto:no_engine"
    if not p.gpus or not d.gpus:
        return False, "auto:gpus_unknown"
    return not p.gpus.isdisjoint(d.gpus), "engines"


def load_facts(
    prefill: InstanceView | None,
    decode: InstanceView | None,
    now: float,
    *,
    default_step_ms: float = 15.0,
    gpu_setting: bool | Literal["auto"] = "auto",
) -> LoadFacts:
    """What the policy is told of the engines' load for a turn that would use ``prefill`` and ``decode``
    (``default_step_ms``: D's step where it measured none, for its queue; ``gpu_setting``: the setting
    ``shared_gpu``)."""
    step, step_src = decode_step(decode)
    shared, shared_src = shared_gpu(gpu_setting, prefill, decode)
    ctx, ctx_src = decode_context(decode)
    queue, queue_src = prefill_queue(prefill, now)
    dqueue, dqueue_src = decode_queue(decode, default_step_ms)
    return LoadFacts(
        decode_step_ms=step,
        decode_context_tokens=ctx,
        prefill_queue_ms=queue,
        decode_queue_ms=dqueue,
        decode_running=decode.busy if decode is not None else 0,
        decode_waiting=decode.waiting_now if decode is not None else 0,
        decode_kv_usage=decode.kv_usage_now if decode is not None else 0.0,
        prefill_waiting=prefill_waiting(prefill),
        decode_prefills=decode.local_prefills if decode is not None else 0,
        decode_prefill_tokens=decode.local_prefill_tokens if decode is not None else 0,
        shared_gpu=shared,
        sources={
            "decode_step_ms": step_src,
            "decode_context_tokens": ctx_src,
            "prefill_queue_ms": queue_src,
            "decode_queue_ms": dqueue_src,
            "shared_gpu": shared_src,
        },
    )
