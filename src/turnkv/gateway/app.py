"""``create_app(settings)``: the gateway as an ASGI app, with everything it owns built in its lifespan.

The lifespan owns the engine (``turnkv.engine``: for vLLM, one aiohttp session), one store (Redis pool
or in-process), the engine registry and its background loops (engine health and metrics, the
pinned-memory report, the releaser, the template audit, the pings of store nodes that are down), all
cancelled, and waited for, when the app stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypedDict

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute, Route

from turnkv.config import Settings
from turnkv.engine import open_engine
from turnkv.engine.base import Engine
from turnkv.errors import GatewayError, UpstreamError, UpstreamStatus, UpstreamUnavailable
from turnkv.gateway import routes as endpoints
from turnkv.gateway.audit import classify, engine_renderer
from turnkv.gateway.decode_admission import DecodeAdmission
from turnkv.gateway.edge import Edge, EdgeMiddleware
from turnkv.gateway.error_responses import on_gateway_error, on_http_exception, on_unexpected
from turnkv.gateway.fleet import Fleet
from turnkv.gateway.hot import GatewayApp, TurnRoute
from turnkv.gateway.lifecycle import Drain
from turnkv.gateway.messages import routes as messages_routes
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.gateway.pins import PinKeeper
from turnkv.gateway.release import Releaser
from turnkv.gateway.responses import routes as responses_routes
from turnkv.gateway.services import Catalog, Services, TemplateAudit
from turnkv.gateway.tally import Tally
from turnkv.gateway.turn import report
from turnkv.gateway.writeback import WriteBacks
from turnkv.logging import make_logger
from turnkv.reuse.assess import TemplateClass
from turnkv.reuse.cost import CostParams
from turnkv.reuse.estimator import CostEstimator
from turnkv.reuse.policies import build_policy
from turnkv.routing import Router, build_profile
from turnkv.state.base import ConversationStore
from turnkv.state.breaker import BreakerPolicy
from turnkv.state.guard import StoreGuard
from turnkv.state.memory import MemoryStore
from turnkv.state.redis import RedisStore, TLSOptions

AUDIT_FIRST_WAIT_S = 1.0  # the start-up audit's retries: the first wait, doubling up to the longest
AUDIT_MAX_WAIT_S = 30.0
AUDIT_ATTEMPT_S = 150.0  # one attempt: a model list and up to four renders, each bounded by its own timeout
STARTUP_AUDIT_S = 3.0
STOP_LOOPS_S = 5.0
STOP_TICK_S = 0.1
SHUTDOWN_RELEASE_S = 5.0
WARM_WITHIN_S = 5.0  # opening the Redis pool at start; a Redis not there yet is met by the first calls
logger = logging.getLogger("turnkv.app")
# vLLM's pooling endpoints, passed to the engines; the APIs' endpoints turnkv does not serve (a 501 each)
POOLING_PATHS = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/v2/rerank", "/rerank", "/pooling", "/classify")
NOT_SERVED_PATHS = tuple(
    f"/v1/{area}{tail}"
    for area in ("audio", "images", "files", "batches", "fine_tuning", "moderations", "assistants", "threads")
    + ("vector_stores", "uploads", "realtime", "conversations", "evals", "containers", "messages/batches")
    for tail in ("", "/{rest:path}")
)
ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE"]
# what a browser's script may read of an answer: its ids and every decision header a turn can carry
EXPOSED_HEADERS = ("x-request-id", "request-id", "retry-after", *report.HEADERS, "x-turnkv-conversation")
# the one route table: Starlette routes them all, the fast path (gateway/hot.py) serves its TurnRoute rows
ROUTES: tuple[BaseRoute, ...] = (
    TurnRoute("/v1/chat/completions", endpoints.chat_completions),
    TurnRoute("/v1/completions", endpoints.completions),
    TurnRoute("/v1/responses", responses_routes.create),
    Route("/v1/responses/{response_id}", responses_routes.retrieve, methods=["GET"]),
    Route("/v1/responses/{response_id}", responses_routes.delete, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/cancel", responses_routes.cancel, methods=["POST"]),
    Route("/v1/responses/{response_id}/input_items", responses_routes.input_items, methods=["GET"]),
    TurnRoute("/v1/messages", messages_routes.create),
    Route("/v1/messages/count_tokens", messages_routes.count_tokens, methods=["POST"]),
    Route("/v1/models", endpoints.models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", endpoints.model, methods=["GET"]),
    *(Route(path, endpoints.pooling, methods=["POST"]) for path in POOLING_PATHS),
    *(Route(path, endpoints.not_served, methods=ANY_METHOD) for path in NOT_SERVED_PATHS),
    Route("/tokenize", endpoints.tokenize, methods=["POST"]),
    Route("/detokenize", endpoints.detokenize, methods=["POST"]),
    Route("/version", endpoints.version, methods=["GET"]),
    Route("/health", endpoints.health, methods=["GET"]),
    Route("/ready", endpoints.ready, methods=["GET"]),
    Route("/metrics", endpoints.metrics, methods=["GET"]),
)


class State(TypedDict):
    services: Services


def cost_priors(settings: Settings) -> CostParams:
    """The cost model's priors: ``costs:``, with what the doctor measured (``profile:``) in their place."""
    c = settings.costs
    base = CostParams(
        link_fixed_s=c.link_fixed_ms / 1e3,
        link_bytes_per_s=c.link_gbps * 1e9,
        push_fixed_s=None if c.push_link_fixed_ms is None else c.push_link_fixed_ms / 1e3,
        push_bytes_per_s=None if c.push_link_gbps is None else c.push_link_gbps * 1e9,
        kv_bytes_per_token=settings.kv_bytes_per_token,
        prefill_per_token_s=c.prefill_us_per_token / 1e6,
        prefill_attn_s=c.prefill_attn_ns / 1e9,
        prefill_floor_s=c.prefill_floor_ms / 1e3,
        hop_s=c.hop_ms / 1e3,
        recompute_threshold=c.recompute_threshold,
    )
    return base if settings.measured is None else settings.measured.priors(base)


def breaker_policy(settings: Settings) -> BreakerPolicy:
    b = settings.store_breaker
    return BreakerPolicy(
        failures=b.failures,
        span_s=b.span_s,
        ratio=b.ratio,
        window_s=b.window_s,
        min_calls=b.min_calls,
        open_s=settings.store_retry_s,
        max_open_s=max(b.max_open_s, settings.store_retry_s),
    )


def _store(settings: Settings) -> ConversationStore:
    s = settings
    if s.redis_url:
        tls = TLSOptions(
            ca_certs=s.redis_tls_ca_certs,
            certfile=s.redis_tls_certfile,
            keyfile=s.redis_tls_keyfile,
            cert_reqs=s.redis_tls_cert_reqs,
            check_hostname=s.redis_tls_check_hostname,
        )
        return RedisStore.from_url(
            s.redis_url,
            namespace=s.redis_namespace,
            command_timeout_s=s.timeouts.redis_s,
            connect_timeout_s=s.timeouts.redis_connect_s,
            connect_concurrency=s.redis_connect_concurrency,
            pool_timeout_s=s.redis_pool_timeout_s,
            max_connections=s.redis_max_connections,
            in_flight_ttl_s=s.redis_in_flight_ttl_s,
            tls=tls,
        )
    return MemoryStore()


async def _report(svc: Services) -> None:
    """Every scrape interval: the link estimates, and which engines the gateway counts healthy."""
    while True:
        await asyncio.sleep(svc.settings.scrape_interval_s)
        for role in ("prefill", "decode"):
            for view in svc.fleet.views(role):
                svc.metrics.engine_up.labels(role, view.url).set(1 if view.healthy else 0)
        for direction, link in svc.estimator.links().items():
            svc.metrics.link_fixed_s.labels(direction).set(link.fixed_s)
            svc.metrics.link_bytes_per_s.labels(direction).set(link.bytes_per_s)
            svc.metrics.link_samples.labels(direction).set(link.samples)


async def _audit_once(svc: Services) -> bool:
    """Learn the served model names and classify the chat template; False when no engine answered."""
    try:
        base = svc.render_base()
    except UpstreamUnavailable:
        return False  # nothing to ask yet: the next attempt may find an engine
    try:
        if not svc.catalog.models:
            cards = await svc.engine.models(base)
            if cards is not None:
                svc.catalog.learned(
                    [c.name for c in cards], {c.name: c.max_model_len for c in cards if c.max_model_len is not None}
                )
        if not svc.settings.template_audit:
            return True
        model = next(iter(svc.models), None)
        try:
            cls, detail = await classify(engine_renderer(svc.engine, base, model))
        except UpstreamStatus as exc:
            if exc.upstream_status >= 500:
                raise
            # the template may not take tools: classify on a conversation without tool calls
            cls, detail = await classify(engine_renderer(svc.engine, base, model, tools=False), tools=False)
            detail += " (probed without tools: the tool probe was refused)"
    except (UpstreamError, ValueError, KeyError) as exc:
        if svc.catalog.template.detail == "not audited yet":
            svc.log.warning("template.audit_failed", engine=base, error=str(exc))
        svc.catalog.audited(TemplateAudit(TemplateClass.UNKNOWN, f"audit failed: {exc}"))
        return False
    svc.catalog.audited(TemplateAudit(cls, detail))
    for c in TemplateClass:
        svc.metrics.template_class.labels(c.value).set(1 if c is cls else 0)
    svc.log.info("template.audit", template_class=cls.value, detail=detail)
    return True


async def _audit_until_done(svc: Services) -> None:
    """Audit until it succeeds: engines can come up minutes after the gateway (vLLM loading a model, a
    container restarted). Each attempt is bounded by AUDIT_ATTEMPT_S; the waits between attempts double
    from AUDIT_FIRST_WAIT_S to AUDIT_MAX_WAIT_S. It ends when the app stops (the task is cancelled)."""
    wait = AUDIT_FIRST_WAIT_S
    while True:
        done = False
        with anyio.move_on_after(AUDIT_ATTEMPT_S) as scope:
            done = await _audit_once(svc)
        if done:
            return
        if scope.cancelled_caught:
            svc.log.warning("template.audit_timeout", timeout_s=AUDIT_ATTEMPT_S, next_attempt_s=wait)
        await asyncio.sleep(wait)
        wait = min(wait * 2, AUDIT_MAX_WAIT_S)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("background.crashed task=%s", task.get_coro(), exc_info=task.exception())


async def stop_tasks(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the background loops and wait for them, bounded. A cancellation can be lost inside a
    library (redis-py and aiohttp can turn one that meets their own timeout into a timeout error,
    which a loop then survives), so it is repeated until every loop has ended."""
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + STOP_LOOPS_S
    while pending and time.monotonic() < deadline:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=STOP_TICK_S)
    if pending:
        logger.error("background.not_stopped tasks=%s", [t.get_coro() for t in pending])


async def _shut_down(svc: Services) -> None:
    """After the last connection closed: give back the handles nobody will pull, with a store nobody else
    reads every pin too, and send the releases still queued (bounded: D frees them at its TTL otherwise)."""
    with anyio.move_on_after(SHUTDOWN_RELEASE_S):
        if svc.settings.decode_memory.release_on_shutdown:
            svc.pins.release_unused()  # handles nobody will pull, left to D's TTL: nobody's, whatever the store
        if svc.settings.decode_memory.release_on_shutdown and not svc.settings.redis_url:
            n = await svc.pins.release_all()
            if n:
                svc.log.info("pins.shutdown", released=n)
        await svc.write_backs.drain(SHUTDOWN_RELEASE_S)  # each written back, or its handle released
        await svc.releaser.drain(SHUTDOWN_RELEASE_S)


async def _warm(store: RedisStore, connections: int, log: Any) -> None:
    opened = await store.warm(connections, within_s=WARM_WITHIN_S)
    log.info("store.warm", connections=opened)


async def _stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)


def create_app(
    settings: Settings,
    *,
    multiprocess_dir: str | None = None,
    drain: Drain | None = None,
    engine: Engine | None = None,
    store: ConversationStore | None = None,
    routes: Sequence[BaseRoute] = ROUTES,
    tally: Tally | None = None,
) -> Starlette:
    """The gateway; ``multiprocess_dir`` is set by ``serve --workers N`` (workers.py): where the workers'
    metrics meet, so that /metrics reports all of them. ``drain`` is how the server that runs the app
    tells it a shutdown began (``gateway.server``). ``engine`` and ``store``: used instead of the ones
    the settings name (tests pass an engine double, ``engine.mock.MockEngine`` or the simulator-backed
    one, and a store of their own). ``routes``: the route table (``ROUTES``, or one with a front end of the
    caller's own). ``tally``: where the edge counts what clients hold (``gateway.tally``), shared with the
    server's connection limits and, with ``--workers``, with the other workers."""
    drain = drain or Drain(settings.drain_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[State]:
        metrics = GatewayMetrics(multiprocess_dir, prefill=settings.prefill, decode=settings.decode)
        drain.on_count = metrics.inflight_turns.set
        drain.on_draining = lambda: metrics.draining.set(1)
        log = make_logger("turnkv.turn", json=settings.log_json)
        if multiprocess_dir is not None:
            log = log.bind(worker=os.getpid())  # which of the workers served a turn
        backing = store if store is not None else _store(settings)
        guard = StoreGuard(
            backing,
            policy=breaker_policy(settings),
            on_error=lambda op, kind: metrics.redis_errors.labels(op, kind).inc(),
            on_state=lambda up: metrics.store_up.set(1 if up else 0),
            on_node=lambda node, is_open: metrics.store_breaker_open.labels(node).set(1 if is_open else 0),
            on_busy=lambda op: metrics.store_busy.labels(op).inc(),
            on_skip=lambda op: metrics.store_skipped.labels(op).inc(),
        )
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(backing, RedisStore) and settings.redis_warm_connections:
                warming = asyncio.create_task(_warm(backing, settings.redis_warm_connections, log))
                stack.push_async_callback(_stop_task, warming)
                # serve once the pool is open, or once its deadline passed in any case: a warm-up that
                # outlives it (seen once in ~8 runs behind a slow path) goes on in the background
                await asyncio.wait({warming}, timeout=WARM_WITHIN_S + 1.0)
            eng = engine if engine is not None else await stack.enter_async_context(open_engine(settings))
            fleet = Fleet(settings.prefill, settings.decode, settings.block_size)
            router = Router(build_profile(settings.routing, settings.routing_profiles), fleet.views)
            estimator = CostEstimator(cost_priors(settings), link_max_age_s=settings.costs.link_max_age_s)
            fleet.on_link_sample = estimator.observe_link
            fleet.on_restart = lambda view: metrics.engine_restarts.labels(view.role).inc()
            catalog = Catalog()
            releaser = Releaser(eng, router, metrics, lambda: next(iter(settings.models or catalog.models), None))
            releaser.on_held = fleet.let_go  # released handles count in D's KV in use until sent
            pins = PinKeeper(settings, fleet, guard.pins, releaser, metrics, log)
            write_backs = WriteBacks(eng, fleet, metrics, settings.write_back, releaser.submit, releaser.model)
            fleet.on_scraped = pins.on_scraped
            dm = settings.decode_memory
            admission = DecodeAdmission(
                capacity=lambda url: pins.capacity(url) if dm.admit_share > 0 else None,
                pinned=pins.pinned,
                admit_share=dm.admit_share,
                wait_s=dm.admission_wait_s,
                on_wait=lambda url: metrics.admission_waits.labels(url).inc(),
            )
            pins.on_change = admission.wake
            svc = Services(
                settings=settings,
                engine=eng,
                fleet=fleet,
                router=router,
                store=guard,
                policy=build_policy(settings.policy.name, settings.policy.params),
                estimator=estimator,
                metrics=metrics,
                log=log,
                releaser=releaser,
                pins=pins,
                write_backs=write_backs,
                admission=admission,
                drain=drain,
                catalog=catalog,
            )
            audited = False
            with anyio.move_on_after(STARTUP_AUDIT_S):
                audited = await _audit_once(svc)  # engines already up: know the template before serving
            loops = [
                fleet.run(eng, settings.health_interval_s, settings.scrape_interval_s),
                _report(svc),
                releaser.run(),
                write_backs.run(),
                pins.run(),
                guard.watch(),  # an open breaker's node pinged until it answers
                *([] if audited else [_audit_until_done(svc)]),
            ]
            tasks = [asyncio.create_task(c) for c in loops]
            for t in tasks:
                t.add_done_callback(_log_crash)
            try:
                yield {"services": svc}
            finally:
                await _shut_down(svc)
                await stop_tasks(tasks)
        if store is None:  # a store passed in is its owner's to close
            await guard.close()

    cors = settings.cors
    edge = Edge(settings, tally)
    middleware = [Middleware(EdgeMiddleware, edge=edge)]
    if cors.allow_origins:  # outermost: a browser's preflight is answered without credentials
        middleware.insert(
            0,
            Middleware(
                CORSMiddleware,
                allow_origins=cors.allow_origins,
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=cors.allow_headers,
                allow_credentials=cors.allow_credentials,
                max_age=cors.max_age_s,
                expose_headers=list(EXPOSED_HEADERS),
            ),
        )
    app = GatewayApp(
        routes=routes,
        edge=edge,
        fast=not cors.allow_origins,  # the turns skip Starlette's stack (gateway/hot.py), unless CORS must see them
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={GatewayError: on_gateway_error, HTTPException: on_http_exception, Exception: on_unexpected},
    )
    app.state.drain = drain  # for the server (gateway.server): told when a shutdown begins
    app.state.shutdown_delay_s = settings.shutdown_delay_s
    return app
