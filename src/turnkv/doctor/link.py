"""Pure figures from what the probes measured: each direction's link (fixed cost and bandwidth), P's
compute, KV bytes per token, the history length above which a pull beats recomputing, and what the
GPUs' path should do where the host can tell.

The link is a line through the transfers seen (``reuse.estimator.fitted``: at least three of varied
sizes), else the mean rate of what was seen. P's compute is the gateway's prefill model fitted to P's
cold prefills: ``hop + a*n + b*n*n/2`` for ``n`` tokens, a call as the gateway times it. The break-even
is decided by the gateway's own cost model (``reuse.cost.estimate``) with these figures, so it is what
the adaptive policy will decide on this pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from turnkv.doctor.facts import EngineFacts, HostFacts, Sample, SizeRun
from turnkv.profile import ComputeFigures, LinkFigures
from turnkv.reuse.cost import Action, CostParams, TurnFacts, estimate
from turnkv.reuse.estimator import fitted
from turnkv.reuse.lstsq import lstsq

GB = 1e9
# the least a path should move KV at (bytes/s); "far below" is under a quarter of it
FLOORS = {
    "one GPU": 10 * GB,  # CUDA IPC within one device (one H200: P->D 172-352 GB/s, D->P 5-21 GB/s)
    "NVLink": 50 * GB,
    "PCIe peer-to-peer": 10 * GB,
    "host memory": 5 * GB,  # staged through the host: no peer-to-peer between the GPUs
}
FAR_BELOW = 4.0
TCP_LIKE = 1 * GB  # below this, KV most likely moves over TCP whatever the path


@dataclass(frozen=True)
class LinkFit:
    fixed_s: float
    bytes_per_s: float
    samples: int
    line: bool  # a line through varied sizes (else the mean rate seen, fixed cost unknown)

    def figures(self) -> LinkFigures:
        return LinkFigures(
            fixed_ms=round(self.fixed_s * 1e3, 4), gbps=round(self.bytes_per_s / GB, 4), samples=self.samples
        )


def fit_link(samples: Sequence[Sample]) -> LinkFit | None:
    pts = [(s.mean_bytes, s.mean_seconds, s.count) for s in samples if s.bytes > 0 and s.seconds > 0]
    if not pts:
        return None
    line = fitted(pts)
    if line is not None:
        return LinkFit(line[0], line[1], len(pts), True)
    total_b = sum(b * c for b, _, c in pts)
    total_s = sum(s * c for _, s, c in pts)
    return LinkFit(0.0, total_b / total_s, len(pts), False)


def fit_compute(runs: Sequence[SizeRun], prior: CostParams) -> ComputeFigures | None:
    """P's compute from its cold prefills: all three terms from three sizes or more; from fewer, the
    prior's attention term (and, from one, its hop) stand."""
    pts = [(r.tokens, r.prefill_s) for r in runs if r.prefill_s is not None and r.prefill_s > 0]
    if not pts:
        return None
    sizes = {n for n, _ in pts}
    hop, a, b = prior.hop_s, prior.prefill_per_token_s, prior.prefill_attn_s
    full = lstsq([([1.0, n / 1e3, n * n / 2 / 1e9], s, 1.0) for n, s in pts]) if len(sizes) >= 3 else None
    if full is not None and min(full) >= 0 and full[1] > 0:
        hop, a, b = full[0], full[1] / 1e3, full[2] / 1e9
    elif len(sizes) >= 2:
        two = lstsq([([1.0, n / 1e3], s - b * n * n / 2, 1.0) for n, s in pts])
        if two is not None and two[0] >= 0 and two[1] > 0:
            hop, a = two[0], two[1] / 1e3
    else:
        n, s = pts[0]
        a = max((s - hop - b * n * n / 2) / n, 1e-9)
    return ComputeFigures(
        hop_ms=round(hop * 1e3, 4), us_per_token=round(a * 1e6, 5), attn_ns=round(b * 1e9, 5), samples=len(pts)
    )


def kv_bytes_per_token(samples: Sequence[Sample], block_size: int) -> int | None:
    """Bytes per token of KV, from single transfers of whole probe prompts (blocks, not tokens, move)."""
    rates = sorted(s.bytes / (-(-s.tokens // block_size) * block_size) for s in samples if s.count == 1 and s.bytes > 0)
    return round(rates[len(rates) // 2]) if rates else None


def costs(prior: CostParams, pull: LinkFit | None, push: LinkFit | None, compute: ComputeFigures | None) -> CostParams:
    """The gateway's cost parameters with what was measured in place of the priors."""
    out = prior
    if pull is not None:
        out = replace(out, link_fixed_s=pull.fixed_s, link_bytes_per_s=pull.bytes_per_s)
    if push is not None:
        out = replace(out, push_fixed_s=push.fixed_s, push_bytes_per_s=push.bytes_per_s)
    if compute is not None:
        out = replace(
            out,
            hop_s=compute.hop_ms / 1e3,
            prefill_per_token_s=compute.us_per_token / 1e6,
            prefill_attn_s=compute.attn_ns / 1e9,
        )
    return out


def turn_estimate(p: CostParams, history: int, turn: int, block_size: int) -> dict[Action, float]:
    """The gateway's TTFT estimates for a turn of ``turn`` new tokens after ``history`` tokens that D holds
    and P does not (another P, or P's cache lost them)."""
    facts = TurnFacts(
        prompt_tokens=history + turn,
        reusable_tokens=history,
        prefill_cached_tokens=0,
        decode_cached_tokens=0,
        decode_local_possible=False,
    )
    return estimate(p, facts, block_size)


def pull_pays(p: CostParams, history: int, turn: int, block_size: int) -> bool:
    est = turn_estimate(p, history, turn, block_size)
    return Action.PULL in est and est[Action.PULL] < est[Action.RECOMPUTE]


def break_even(p: CostParams, turn: int, longest: int, block_size: int) -> int | None:
    """The shortest history (whole blocks) above which a pull beats recomputing, up to ``longest``
    tokens of prompt; None when it never does. The difference shrinks as history grows (P's compute
    grows faster than the transfer), so a bisection finds it."""
    hi = (longest - turn) // block_size
    if hi <= 0 or not pull_pays(p, hi * block_size, turn, block_size):
        return None
    lo = 0  # no history: nothing to pull
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pull_pays(p, mid * block_size, turn, block_size):
            hi = mid
        else:
            lo = mid
    return hi * block_size


@dataclass(frozen=True)
class Expectation:
    """What the path between P's and D's GPUs should do, as far as this machine can tell."""

    path: str  # one GPU, NVLink, PCIe peer-to-peer, host memory, same host, hosts, unknown
    floor_bytes_per_s: float | None
    same_host: bool | None
    detail: str


def expect(p: EngineFacts, d: EngineFacts, host: HostFacts) -> Expectation:
    same = _same_host(p, d)
    pg = p.description.gpus if p.description else frozenset()
    dg = d.description.gpus if d.description else frozenset()
    if pg and dg and pg & dg:
        return Expectation("one GPU", FLOORS["one GPU"], True, "P and D compute on the same GPU")
    if same is not True:
        detail = "P and D are on different hosts" if same is False else "cannot tell whether P and D share a host"
        return Expectation("hosts" if same is False else "unknown", None, same, detail)
    if not (pg and dg):
        return Expectation("same host", None, True, "the engines do not say which GPUs they compute on")
    if not (p.local and d.local) or not host.nvidia_smi:
        why = host.detail or "the engines are not on this machine"
        return Expectation("same host", None, True, f"cannot read the GPUs' topology here ({why})")
    return _between(sorted(pg), sorted(dg), host)


def _between(pg: list[str], dg: list[str], host: HostFacts) -> Expectation:
    """The path from P's first GPU to D's, as this machine's topology says it."""
    pi = [host.uuids[g] for g in pg if g in host.uuids]
    di = [host.uuids[g] for g in dg if g in host.uuids]
    if not pi or not di:
        return Expectation("same host", None, True, "nvidia-smi does not list the engines' GPUs")
    i, j = pi[0], di[0]
    topo, p2p = host.topology.get((i, j), ""), host.p2p.get((i, j), "")
    path = "NVLink" if topo.startswith("NV") else ("PCIe peer-to-peer" if p2p == "OK" else "host memory")
    detail = f"GPU{i} -> GPU{j}: topology {topo or '?'}, peer-to-peer read {p2p or '?'}"
    return Expectation(path, FLOORS[path], True, detail)


def _same_host(p: EngineFacts, d: EngineFacts) -> bool | None:
    if p.local and d.local:
        return True
    ph, dh = _host(p.url), _host(d.url)
    return True if ph == dh else None


def _host(url: str) -> str:
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit(":", 1)[0].strip("[]")


def far_below(rate: float, e: Expectation) -> str | None:
    """Why ``rate`` is far below what the path should do; None when it is not."""
    if e.floor_bytes_per_s is not None and rate < e.floor_bytes_per_s / FAR_BELOW:
        return f"far below what {e.path} should do (at least {e.floor_bytes_per_s / GB:.0f} GB/s)"
    if rate < TCP_LIKE:
        return "below 1 GB/s: KV most likely moves over TCP"
    return None
