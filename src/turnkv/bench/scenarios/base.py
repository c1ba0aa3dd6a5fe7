"""Configurations and how one is run: start its processes, send the load, measure, stop.

A deployment is ``colocated`` (one engine, or several side by side with each conversation sticking
to one, the load sent to them), ``pd`` (P and D engines, any number of each, behind a turnkv gateway,
optionally with a redis-server of its own) or ``pd-direct`` (one P and one D engine, the client runs
the P/D handshake itself: no proxy). Around the load the runner reads the gateway's
CPU time from /proc, Redis command counts, and the gateway's /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from turnkv import launch
from turnkv.bench import procs
from turnkv.bench.baseline_relay import SERVERS
from turnkv.bench.client import Target
from turnkv.bench.records import ConfigResult
from turnkv.bench.redis_server import RedisServer
from turnkv.bench.runner import run_load
from turnkv.bench.sampler import ResourceSampler
from turnkv.bench.watch import MetricWatch
from turnkv.bench.workload import WorkloadSpec

ENGINE_METRICS = ("vllm:prompt_tokens_by_source", "vllm:prefix_cache", "vllm:nixl_", "vllm:num_preemptions", "sim:")
GATEWAY_METRICS = (
    "turnkv_reuse_decisions",
    "turnkv_link_",
    "turnkv_handle_captures",
    "turnkv_retries",
    "turnkv_upstream_errors",
    "turnkv_render_mismatch",
    "turnkv_tokens",
    "turnkv_write_backs",
    "turnkv_handle_releases",
    "turnkv_unused_handles_left",
)


def _times(n: int) -> str:
    return f" (x{n})" if n > 1 else ""


@dataclass(frozen=True)
class Deployment:
    # colocated | relay (the bare relay in front of one colocated engine) | pd | pd-direct | pd-relay (the bare
    # relay making vLLM's P/D handshake)
    kind: str
    engine_flags: tuple[str, ...] = ()  # every engine
    prefill_flags: tuple[str, ...] = ()
    decode_flags: tuple[str, ...] = ()
    gateway_flags: tuple[str, ...] = ()
    gateway_env: tuple[tuple[str, str], ...] = ()  # TURNKV_* settings without a flag
    redis: bool = False
    count_redis_round_trips: bool = False  # route Redis through the counting relay
    pin: bool = False  # gateway on CPU 1 (1..N with N workers); engines, redis and the load generator on CPU 0
    gateway_workers: int = 1  # turnkv serve --workers N (needs Redis)
    prefills: int = 1  # engines of each role (pd); colocated: engines side by side
    decodes: int = 1
    replicas: int = 1
    relay_server: str = "aiohttp"  # relay, pd-relay: aiohttp.web, or uvicorn with a bare ASGI app (baseline_asgi)
    shared_gpu: bool = False  # pd, pd-direct: every engine on one GPU, sharing its compute (the sim's --gpu-share-file)
    four_hop: bool = False  # pd: tokens-only P and D behind a render service (engine vllm-four-hop)

    def __post_init__(self) -> None:
        if min(self.prefills, self.decodes, self.replicas) < 1:
            raise ValueError("a deployment has at least one engine of each kind it uses")
        if self.kind in ("pd-direct", "pd-relay") and (self.prefills, self.decodes) != (1, 1):
            raise ValueError(f"{self.kind} drives one P and one D")
        if self.relay_server not in SERVERS:
            raise ValueError(f"relay_server is one of {', '.join(SERVERS)}")

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "engine_flags": list(self.engine_flags),
            "prefill_flags": list(self.prefill_flags),
            "decode_flags": list(self.decode_flags),
            "gateway_flags": list(self.gateway_flags),
            "gateway_env": dict(self.gateway_env),
            "redis": self.redis,
            "pinned": self.pin,
            "gateway_workers": self.gateway_workers,
            "prefills": self.prefills,
            "decodes": self.decodes,
            "replica_engines": self.replicas,
            "four_hop": self.four_hop,
            "relay_server": self.relay_server,
            "shared_gpu": self.shared_gpu,
        }

    @property
    def relay_flags(self) -> list[str]:
        return [] if self.relay_server == "aiohttp" else ["--server", self.relay_server]

    def commands(self) -> list[str]:
        """The equivalent shell commands (ports are picked at start: shown as placeholders)."""
        e = " ".join(self.engine_flags)
        if self.shared_gpu:
            e = f"{e} --gpu GPU-0 --gpu-share-file $GPU_SHARE_FILE".strip()
        if self.kind == "colocated":
            return [f"turnkv sim --role colocated {e}".strip() + _times(self.replicas)]
        if self.kind == "relay":
            relay = " ".join(["python -m turnkv.bench.baseline_relay --upstream $E", *self.relay_flags])
            return [f"turnkv sim --role colocated {e}".strip(), relay]
        out = [
            f"turnkv sim --role prefill {e} {' '.join(self.prefill_flags)}".strip() + _times(self.prefills),
            f"turnkv sim --role decode {e} {' '.join(self.decode_flags)}".strip() + _times(self.decodes),
        ]
        if self.kind == "pd-relay":
            relay = "python -m turnkv.bench.baseline_relay --prefill $P --upstream $D"
            out.append(" ".join([relay, *self.relay_flags]))
        if self.four_hop:
            out = [line.replace(" --role prefill", " --role prefill --tokens-only") for line in out]
            out = [line.replace(" --role decode", " --role decode --tokens-only --turnkv-plugin") for line in out]
            out.insert(0, f"turnkv sim --role render {e}".strip())
        if self.kind == "pd":
            redis = " --redis-url redis://127.0.0.1:$REDIS_PORT/0" if self.redis else ""
            env = "".join(f"{k}={v} " for k, v in self.gateway_env)
            if self.four_hop:
                env = f"TURNKV_ENGINE=vllm-four-hop TURNKV_RENDER=$R {env}"
            workers = f" --workers {self.gateway_workers}" if self.gateway_workers > 1 else ""
            ps = " ".join(f"$P{i}" for i in range(self.prefills)) if self.prefills > 1 else "$P"
            ds = " ".join(f"$D{i}" for i in range(self.decodes)) if self.decodes > 1 else "$D"
            out.append(
                f"{env}turnkv serve --prefill {ps} --decode {ds} {' '.join(self.gateway_flags)}{redis}{workers}".strip()
            )
        return out


@dataclass(frozen=True)
class ConfigPlan:
    """One measured configuration: a name, the load, and free-form tags the analysis reads."""

    name: str
    group: str
    description: str
    workload: WorkloadSpec
    tags: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sampling:
    """How the processes' RSS and open fds are sampled around a load: every ``interval_s`` from just
    before it until ``settle_s`` after it ended (the idle state it leaves behind)."""

    interval_s: float = 1.0
    settle_s: float = 5.0


@dataclass(frozen=True)
class Bench:
    """A deployment and the loads run on it, one after the other (each with its own seed)."""

    deployment: Deployment
    plans: tuple[ConfigPlan, ...]
    warmup: WorkloadSpec | None = None
    sample: Sampling | None = None  # RSS and open fds of the processes over each load
    watch: tuple[str, ...] = ()  # engine metrics read every half second over each load (``bench.watch``)


def with_duration(bench: Bench, duration_s: float | None) -> Bench:
    """The bench with every load's duration (no request starts after it) set to ``duration_s``."""
    if duration_s is None:
        return bench
    plans = tuple(replace(p, workload=replace(p.workload, duration_s=duration_s)) for p in bench.plans)
    return replace(bench, plans=plans)


def with_gateway_workers(bench: Bench, n: int) -> Bench:
    """The bench with its gateway run as ``n`` workers, which share conversations through Redis."""
    d = bench.deployment
    if n <= 1 or d.kind != "pd":
        return bench
    return replace(bench, deployment=replace(d, gateway_workers=n, redis=True))


@dataclass
class Deployed:
    target: Target
    gateway: launch.Running | None
    engines: list[launch.Running]
    redis: RedisServer | None
    relay: procs.RoundTripRelay | None


def _start_engines(
    specs: Sequence[tuple[str, str, tuple[str, ...]]], log_dir: Path, started: list[launch.Running]
) -> list[launch.Running]:
    """Start engines ``(name, role, flags)`` at once; every one that started is in ``started`` (to be
    stopped) even when another failed, whose error is raised."""
    with ThreadPoolExecutor(max(1, len(specs))) as pool:
        futures = [pool.submit(launch.sim, name, role, *flags, log_dir=log_dir) for name, role, flags in specs]
        out: list[launch.Running] = []
        errors: list[BaseException] = []
        for f in futures:
            try:
                out.append(f.result())
            except Exception as exc:  # raised below, once the others are recorded
                errors.append(exc)
    started += out
    if errors:
        raise errors[0]
    return out


def _names(role: str, n: int) -> list[str]:
    return [role] if n == 1 else [f"{role}{i}" for i in range(n)]


@contextlib.contextmanager
def deploy(d: Deployment, log_dir: Path) -> Iterator[Deployed]:
    started: list[launch.Running] = []
    redis: RedisServer | None = None
    relay: procs.RoundTripRelay | None = None
    try:
        if d.kind == "colocated":
            engs = _start_engines(
                [(n, "colocated", d.engine_flags) for n in _names("colocated", d.replicas)], log_dir, started
            )
            target = Target(url=engs[0].url, replicas=tuple(e.url for e in engs[1:]))
            gateway = None
        elif d.kind == "relay":
            eng = launch.sim("colocated", "colocated", *d.engine_flags, log_dir=log_dir)
            started.append(eng)
            gateway = launch.spawn(
                "relay", ["--upstream", eng.url, *d.relay_flags], log_dir=log_dir, module="turnkv.bench.baseline_relay"
            )
            started.append(gateway)
            target = Target(url=gateway.url)
        else:
            common = d.engine_flags
            if d.shared_gpu:  # one device: they say so (a gateway's shared_gpu auto sees it) and share its compute
                common = (*common, "--gpu", "GPU-0", "--gpu-share-file", str(log_dir / "gpu.share"))
            tokens: tuple[str, ...] = ("--tokens-only",) if d.four_hop else ()
            plugin: tuple[str, ...] = ("--turnkv-plugin",) if d.four_hop else ()
            specs = [(n, "prefill", (*common, *d.prefill_flags, *tokens)) for n in _names("prefill", d.prefills)]
            specs += [(n, "decode", (*common, *d.decode_flags, *tokens, *plugin)) for n in _names("decode", d.decodes)]
            if d.four_hop:
                specs.append(("render", "render", common))
            engs = _start_engines(specs, log_dir, started)
            ps, ds = engs[: d.prefills], engs[d.prefills : d.prefills + d.decodes]
            gateway = None
            if d.kind == "pd-direct":
                target = Target(prefill=ps[0].url, decode=ds[0].url)
            elif d.kind == "pd-relay":
                gateway = launch.spawn(
                    "relay",
                    ["--prefill", ps[0].url, "--upstream", ds[0].url, *d.relay_flags],
                    log_dir=log_dir,
                    module="turnkv.bench.baseline_relay",
                )
                started.append(gateway)
                target = Target(url=gateway.url)
            else:
                extra = list(d.gateway_flags)
                if d.gateway_workers > 1:
                    extra += ["--workers", str(d.gateway_workers)]
                if d.redis:
                    redis = RedisServer().start()
                    url = redis.url
                    if d.count_redis_round_trips:
                        relay = procs.RoundTripRelay(redis.port)
                        relay.start()
                        url = relay.url
                    extra += ["--redis-url", url]
                env = {"TURNKV_DECISION_HEADERS": "full", **dict(d.gateway_env)}
                if d.four_hop:
                    env.update(TURNKV_ENGINE="vllm-four-hop", TURNKV_RENDER=engs[-1].url)
                gateway = launch.gateway(
                    "gateway", [p.url for p in ps], [x.url for x in ds], *extra, log_dir=log_dir, env=env
                )
                started.append(gateway)
                target = Target(url=gateway.url)
        if d.pin:
            gateway_cpus = set(range(1, 1 + d.gateway_workers))
            for r in started:
                procs.pin(r.proc.pid, gateway_cpus if r is gateway else {0})
            if gateway is not None:
                for pid in procs.descendants(gateway.proc.pid):  # workers; a restarted one inherits
                    procs.pin(pid, gateway_cpus)
            if redis is not None and redis.proc is not None:
                procs.pin(redis.proc.pid, {0})
        yield Deployed(target, gateway, [r for r in started if r is not gateway], redis, relay)
    finally:
        for r in reversed(started):
            r.stop()
        if relay is not None:
            relay.stop()
        if redis is not None:
            redis.close()


def scrape(url: str, prefixes: Sequence[str]) -> dict[str, float]:
    """Samples from a Prometheus endpoint whose names start with one of ``prefixes``."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(tuple(prefixes)) and not s.name.endswith(("_created", "_bucket")):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def run_bench(bench: Bench, log_root: Path, *, show_progress: bool = True) -> list[ConfigResult]:
    """Deploys, runs the warm-up (not recorded) and each plan's load, and stops the processes."""
    d = bench.deployment
    log_dir = log_root / bench.plans[0].name
    log_dir.mkdir(parents=True, exist_ok=True)
    own_affinity = os.sched_getaffinity(0)
    results: list[ConfigResult] = []
    with deploy(d, log_dir) as dep:
        if d.pin:
            procs.pin(os.getpid(), {0})
        try:
            if bench.warmup is not None:
                asyncio.run(run_load(bench.warmup, dep.target, label="warm-up", show_progress=False))
            for plan in bench.plans:
                results.append(_measure(plan, d, dep, show_progress, bench.sample, bench.watch))
        finally:
            if d.pin:
                os.sched_setaffinity(0, own_affinity)
    return results


def _sampler(dep: Deployed, sampling: Sampling) -> ResourceSampler:
    groups = {e.name: (e.proc.pid, False) for e in dep.engines}
    if dep.gateway is not None:
        groups["gateway"] = (dep.gateway.proc.pid, True)  # with its workers
    if dep.redis is not None and dep.redis.proc is not None:
        groups["redis"] = (dep.redis.proc.pid, False)
    groups["client"] = (os.getpid(), False)
    return ResourceSampler(groups, interval_s=sampling.interval_s)


def _measure(
    plan: ConfigPlan,
    d: Deployment,
    dep: Deployed,
    show_progress: bool,
    sampling: Sampling | None = None,
    watch: Sequence[str] = (),
) -> ConfigResult:
    meta: dict[str, Any] = {"commands": d.commands(), "tags": plan.tags}
    sampler = _sampler(dep, sampling) if sampling is not None else None
    watcher = MetricWatch({e.name: e.url for e in dep.engines}, watch) if watch else None
    if watcher is not None:
        watcher.start()
    if sampler is not None:
        sampler.sample()  # the idle state before the load
        sampler.start()
    gw_pid = dep.gateway.proc.pid if dep.gateway else None
    cpu0 = procs.tree_cpu_seconds(gw_pid) if gw_pid else 0.0
    eng0 = sum(procs.cpu_seconds(e.proc.pid) for e in dep.engines)
    rs0 = dep.redis.commandstats() if dep.redis else {}
    rt0 = dep.relay.round_trips if dep.relay else 0
    cmd0 = dict(dep.relay.by_command) if dep.relay else {}
    t0 = time.perf_counter()
    try:
        records = asyncio.run(run_load(plan.workload, dep.target, label=plan.name, show_progress=show_progress))
    except BaseException:
        if sampler is not None:
            sampler.stop()
        if watcher is not None:
            watcher.stop()
        raise
    wall = time.perf_counter() - t0
    if watcher is not None:
        meta["watched"] = watcher.stop()
    if sampler is not None and sampling is not None:
        time.sleep(sampling.settle_s)  # a measurement window: what the load left behind once idle
        sampler.stop()
        meta["resources"] = sampler.to_dict(
            load_start_s=round(t0 - sampler.t0, 3), load_end_s=round(t0 + wall - sampler.t0, 3)
        )
    if gw_pid:
        meta["gateway_cpu_s"] = procs.tree_cpu_seconds(gw_pid) - cpu0
    meta["engine_cpu_s"] = sum(procs.cpu_seconds(e.proc.pid) for e in dep.engines) - eng0
    if dep.redis:
        meta["redis_commands"] = procs.stats_delta(rs0, dep.redis.commandstats())
    if dep.relay:
        meta["redis_round_trips"] = dep.relay.round_trips - rt0
        meta["redis_round_trips_by_command"] = {
            k: v - cmd0.get(k, 0) for k, v in dep.relay.by_command.items() if v != cmd0.get(k, 0)
        }
    if dep.gateway and d.kind == "pd":
        meta["gateway_metrics"] = scrape(dep.gateway.url, GATEWAY_METRICS)
    meta["engine_metrics"] = {e.name: scrape(e.url, ENGINE_METRICS) for e in dep.engines}
    return ConfigResult(
        name=plan.name,
        group=plan.group,
        description=plan.description,
        workload=plan.workload.to_dict(),
        target={**dep.target.to_dict(), **d.describe()},
        requests=records,
        wall_s=wall,
        meta=meta,
    )
