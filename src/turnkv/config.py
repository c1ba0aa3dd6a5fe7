"""The gateway's settings: one frozen tree, filled from defaults, a YAML file, ``TURNKV_*`` env and flags.

Precedence, lowest first: defaults, ``--config`` YAML, environment (``TURNKV_PREFILL='["http://..."]'``,
``TURNKV_TIMEOUTS__CONNECT_S=1``), command-line flags. Cross-field checks run at start and fail loudly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from turnkv.errors import ConfigError as ConfigError  # raised here, at start
from turnkv.routing.profile import RoutingPlugin as RoutingPlugin
from turnkv.routing.profile import RoutingProfile as RoutingProfile
from turnkv.routing.router import build_profile
from turnkv.state.redis_url import parse_redis_url

if TYPE_CHECKING:
    from turnkv.profile import Profile


class Timeouts(BaseModel):
    model_config = ConfigDict(frozen=True)
    connect_s: float = Field(2.0, gt=0, description="TCP connect to an engine")
    render_s: float = Field(30.0, gt=0, description="whole render call")
    prefill_s: float = Field(300.0, gt=0, description="whole prefill call, KV pull included")
    decode_read_s: float = Field(
        300.0, gt=0, description="longest silence between two decode chunks, whatever D's engine is doing"
    )
    decode_idle_s: float = Field(
        30.0,
        gt=0,
        description="a decode stream that has shown output and then says nothing for this long is ended with an "
        "error event, unless D's engine computed something since it fell silent (busy: it waits on, up to "
        "decode_read_s) or, lost (health probes failing), at once",
    )
    health_s: float = Field(1.0, gt=0, description="one health probe of an engine")
    redis_s: float = Field(0.25, gt=0, description="one Redis command; past it that call runs without state")
    redis_connect_s: float = Field(
        1.0, gt=0, description="opening one Redis connection (TCP, and TLS); a new connection is not a slow command"
    )
    # First-token deadlines: past them the turn is tried once more another way (another engine, or plain
    # P/D without a handle), then answered with an error; never minutes of silence. 30 s is ~8x the worst
    # TTFT p99 seen on the H200 at 32 concurrent conversations (plain P/D, 3.9 s).
    prefill_first_token_s: float = Field(30.0, gt=0, description="a prefill call (max_tokens 1, pull included)")
    decode_first_token_s: float = Field(30.0, gt=0, description="from sending D the turn to its first token")
    decode_per_token_s: float = Field(
        1.0,
        gt=0,
        description="non-streamed turns: allowance per requested token "
        "on top of decode_first_token_s (D answers them only at the end)",
    )


class DecodeMemory(BaseModel):
    """How much decode KV stored handles may pin, and when they are given back (docs/decode-memory.md)."""

    model_config = ConfigDict(frozen=True)
    pin_budget_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="share of each decode engine's KV capacity that "
        "stored handles may pin; above it the pins idle longest are released",
    )
    capacity_tokens: int | None = Field(
        None,
        ge=1,
        description="a decode engine's KV capacity in tokens when its "
        "/metrics does not say (vllm:cache_config_info num_gpu_blocks x block_size)",
    )
    unused_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="share of each decode engine's KV capacity that handles nobody will pull (stateless turns, "
        "handles the policy does not keep) may go on pinning until the engine's own decoder_kv_blocks_ttl frees "
        "them, as plain P/D leaves them; past it the oldest, and under pressure all, are released (a 1-token "
        "request to a prefill engine each); 0: release each at once",
    )
    pressure_kv_usage: float = Field(
        0.9, gt=0, le=1.01, description="D's KV usage at which pins are released (and no turn runs decode-local)"
    )
    local_queue: str = Field(
        "weigh",
        pattern="^(weigh|refuse)$",
        description="requests waiting on a decode engine: weigh (its queue against P's: decode-local only when "
        "D's is not the longer, reuse.room) or refuse (any request waiting on D refuses decode-local)",
    )
    pressure_keep_share: float = Field(
        0.1, ge=0, le=1, description="under pressure, pins are released down to this share of capacity"
    )
    pin: str = Field(
        "auto",
        pattern="^(auto|always)$",
        description="auto: keep a conversation's handle pinned "
        "only when the policy would pull it on the next turn; always: keep every handle",
    )
    admit_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="decode admission (off by default: docs/decode-memory.md): turns in flight on a decode engine "
        "may reserve (prompt and answer tokens) this share of its KV capacity, less "
        "what stored handles pin; others wait in the gateway (0: no admission control; 0.9 when on)",
    )
    admission_wait_s: float = Field(
        60.0,
        gt=0,
        description="how long a decode-local turn may wait for room on a decode engine before it is answered 503 "
        "with Retry-After",
    )
    admission_overflow_s: float = Field(
        20.0,
        gt=0,
        description="how long a turn whose KV P holds for D may wait for room on D; then it goes to D all the same "
        "(keep it below P's kv_lease_duration, 30 s by default, past which P frees what D was to pull)",
    )
    janitor_interval_s: float = Field(
        5.0, gt=0, description="how often pins are checked against budget, pressure, expiry and engine restarts"
    )
    release_on_shutdown: bool = Field(
        True, description="with the in-process store, release every pin on shutdown (nobody else can use them)"
    )


class WriteBackSettings(BaseModel):
    """Write-back (docs/write-back.md): after a turn, D's KV goes to P's prefix cache and D's pin is freed."""

    model_config = ConfigDict(frozen=True)
    mode: str = Field(
        "auto",
        pattern="^(auto|always|off)$",
        description="auto: per conversation, where P's cache has room and keeps what it is given, and the "
        "conversation's think time leaves the transfer off the next turn's path; always: every handle is "
        "written back where P has room; off: handles stay pinned or are let go, as before",
    )
    max_in_flight: int = Field(
        1, ge=1, description="write-backs at once on one prefill engine (each pulls a conversation's KV from D)"
    )
    prefill_max_kv_usage: float = Field(
        0.85,
        gt=0,
        le=1,
        description="P's KV usage (now, as the gateway counts it) above which no write-back is sent to it: one "
        "that cannot be allocated would hold P's first-come queue, and a full P evicts what it is given",
    )
    max_wait_s: float = Field(
        2.0,
        ge=0,
        description="how long a write-back may wait for P to have room and no queue; then D's pin is released "
        "instead (its blocks stay in D's prefix cache)",
    )
    priority: int | None = Field(
        None,
        description="the request priority a write-back is sent with, for a P run with --scheduling-policy "
        "priority (larger: later; live requests have 0): none sends no priority (vLLM refuses one otherwise)",
    )
    min_cache_factor: float = Field(
        0.5,
        ge=0,
        le=1,
        description="auto: the share of expected prefix-cache hits P must have been seen to deliver "
        "(its cache keeps what it is given) for a write-back to pay",
    )
    timeout_s: float = Field(30.0, gt=0, description="one write-back, until P has pulled the blocks")


class PolicySettings(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str = Field("adaptive", description="adaptive | always-pull | never-pull | decode-local")
    params: dict[str, Any] = Field(default_factory=dict, description="the policy's own parameters")


class CostPriors(BaseModel):
    """What the cost model assumes until it has measured the engines (the project's H200 host)."""

    model_config = ConfigDict(frozen=True)
    link_fixed_ms: float = Field(2.0, ge=0, description="fixed cost of one KV transfer D -> P, ms")
    link_gbps: float = Field(0.43, gt=0, description="KV transfer bandwidth D -> P (pulls), GB/s")
    push_link_fixed_ms: float | None = Field(None, ge=0, description="P -> D; default: as D -> P")
    push_link_gbps: float | None = Field(None, gt=0, description="P -> D bandwidth, GB/s; default: as D -> P")
    prefill_us_per_token: float = Field(25.0, ge=0, description="prefill compute per new token, µs")
    prefill_attn_ns: float = Field(1.2, ge=0, description="per new token per token of context")
    prefill_floor_ms: float = Field(10.0, ge=0, description="the least a prefill call costs, ms")
    hop_ms: float = Field(3.0, ge=0, description="one extra engine call (a P/D hop), ms")
    recompute_threshold: int = Field(64, ge=0, description="the engines' kv_recompute_threshold")
    link_max_age_s: float | None = Field(
        30.0,
        gt=0,
        description="a KV transfer measurement counts this long: a direction measured slow under "
        "contention and then unused is estimated afresh (the other direction's figure, else the prior), "
        "so the policy pulls where that pays and measures the link again; none: until 64 newer ones",
    )


class Limits(BaseModel):
    """What one client may hold at the edge. A legitimate client sends its headers in one round trip and its
    body at link speed; these bound what a stalled or trickling one costs (docs/security.md)."""

    model_config = ConfigDict(frozen=True)
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="from a connection's start (or a kept-alive "
        "connection's first byte of its next request) until the request's headers "
        "are complete; past it the connection is closed",
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description="how long an idle kept-alive client connection stays open. Longer than clients keep "
        "idle connections in their own pools (aiohttp 15 s, httpx and the openai SDK 5 s): a client that "
        "reuses one never sends its request on a connection the gateway is closing at that moment "
        "(uvicorn's own 5 s did that to one request in hundreds, a reset or disconnect at the client)",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="reading a whole request body (16 MiB at 4.5 Mbit/s); past it a 408 and the connection is closed",
    )
    send_timeout_s: float = Field(
        60.0,
        gt=0,
        description="longest a client may leave its answer unread while the "
        "gateway's send buffer is full; then the connection is dropped (and D's stream "
        "with it): a client that stops reading cannot hold a turn for ever",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="a request's line and headers; more is answered 431 and the connection closed (uvicorn "
        "buffers headers without limit: 400 connections of 4 MB unfinished headers took 1.7 GiB)",
    )
    max_header_count: int = Field(128, ge=8, description="header lines of one request; more: 431")
    max_client_connections: int = Field(
        8192,
        ge=1,
        description="open client connections; more are answered "
        "503 and closed at once (a GET of /health or /ready is still answered). Lowered at start to fit the "
        "open-file limit",
    )
    max_connections_per_ip: int | None = Field(
        None,
        ge=1,
        description="open connections from one peer address, whatever room is left; none: only the reserve "
        "(reserve_share) holds one address back",
    )
    max_arriving: int = Field(
        256,
        ge=1,
        description="requests whose headers came but whose body is still arriving; more get 503 with "
        "Retry-After. A request takes its place in flight (max_inflight) only once its body is whole, so "
        "stalled uploads hold only this small budget, each until body_timeout_s",
    )
    max_inflight: int = Field(
        2048,
        ge=1,
        description="requests to the engines (turns, tokenize) in flight at once; more get 503 with Retry-After",
    )
    max_inflight_per_ip: int | None = Field(
        None,
        ge=1,
        description="the same per peer address, whatever room is left (429); none: only the reserve holds one "
        "address back",
    )
    max_inflight_per_tenant: int = Field(
        256,
        ge=1,
        description="the same per tenant, when clients are "
        "authenticated (API keys or a trusted proxy); more get 429 with Retry-After",
    )
    reserve_share: float = Field(
        0.125,
        ge=0,
        lt=1,
        description="share of each gateway-wide cap (client connections, requests arriving, requests in flight) "
        "kept for those holding little: once only it is left, a peer address (or, with keys, a tenant) "
        "holding an eighth of it or more gets no more, so one client cannot shut out another however much "
        "it holds. 0: off (behind a load balancer every peer is the balancer)",
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After on a 429 or 503 overload answer")
    max_json_depth: int = Field(64, ge=4, le=512, description="nesting depth of a request body")
    raise_fd_limit: bool = Field(True, description="raise the open-file soft limit to the hard limit at start")


class StoreBreaker(BaseModel):
    """When the conversation store counts as down (``state.breaker``): never on one slow command."""

    model_config = ConfigDict(frozen=True)
    failures: int = Field(3, ge=1, description="failures in a row (no success between) that open the breaker ...")
    span_s: float = Field(0.5, ge=0, description="... when they spread over at least this long")
    ratio: float = Field(0.5, gt=0, le=1, description="or this share of the calls in window_s failed ...")
    window_s: float = Field(10.0, gt=0, description="... the window of that ratio")
    min_calls: int = Field(20, ge=1, description="... over at least this many calls")
    max_open_s: float = Field(8.0, gt=0, description="longest skip: each failed probe doubles store_retry_s up to it")


class Cors(BaseModel):
    """Browser access (Starlette's CORSMiddleware); off while ``allow_origins`` is empty."""

    model_config = ConfigDict(frozen=True)
    allow_origins: list[str] = Field(default_factory=list, description='origins allowed, or ["*"]')
    allow_headers: list[str] = Field(
        default_factory=lambda: ["authorization", "content-type", "x-session-id", "x-request-id"],
        description="request headers a browser may send",
    )
    allow_credentials: bool = Field(False, description="let browsers send cookies and credentials")
    max_age_s: int = Field(600, ge=0, description="how long a browser may cache a preflight answer")


class FourHopSettings(BaseModel):
    """The four-hop engine family (``engine: vllm-four-hop``): render services, tokens-only P and D, derender."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    render: list[str] = Field(
        default_factory=list, description="render service URLs, balanced (default: the one ``render`` names)"
    )
    tokenizer: str | None = Field(
        None,
        description="the model's tokenizer.json (or its folder) for streaming derender in the gateway's process: "
        "one render call an answer; without it the text comes from the render service's /detokenize ('sim': the "
        "simulator's tokenizer, against turnkv sim)",
    )
    reasoning_parser: str | None = Field("qwen3", description="the render service's --reasoning-parser (None: none)")
    tool_parser: str | None = Field("hermes", description="the render service's --tool-call-parser (None: none)")
    derender: Literal["auto", "incremental", "vllm-stream", "final"] = Field(
        "auto",
        description="how a streamed answer is derendered: auto picks turnkv's incremental path where it reads "
        "the parsers, else vLLM's streaming derender (render service 0.31+), else the whole answer at the end",
    )
    flush_tokens: int = Field(16, ge=1, description="D's ids a derender flush waits for (after the first text)")
    flush_ms: float = Field(50.0, ge=0, description="how long D's oldest unflushed id waits at most")


class Settings(BaseSettings):
    """Everything ``turnkv serve`` needs (docs/configuration.md, generated from this model)."""

    model_config = SettingsConfigDict(
        env_prefix="TURNKV_", env_nested_delimiter="__", frozen=True, extra="forbid", hide_input_in_errors=True
    )  # inputs hold secrets

    prefill: list[str] = Field(default_factory=list, description="prefill engine base URLs")
    decode: list[str] = Field(default_factory=list, description="decode engine base URLs")
    render: str | None = Field(None, description="render service URL; default: a prefill engine")
    engine: str = Field("vllm", description="the engines' family, as turnkv.engine.ENGINES names it")
    four_hop: FourHopSettings = Field(default_factory=FourHopSettings, description="engine vllm-four-hop")
    redis_url: str | None = Field(
        None,
        description="redis://host:port/db, rediss:// (TLS), unix://, "
        "redis+sentinel://host:port[,host:port]/service[/db], "
        "redis+cluster://host:port[,host:port]; none: in-process store",
    )
    redis_namespace: str = Field("turnkv", pattern=r"^[^{}]+$", description="prefix of every key turnkv writes")
    redis_max_connections: int = Field(
        256,
        ge=1,
        le=10_000,
        description="store operations in flight at once per gateway process (each holds one connection per Redis node)",
    )
    redis_pool_timeout_s: float = Field(
        0.5,
        gt=0,
        description="longest wait for a free connection; past it "
        "that call runs without state (Redis is not marked down)",
    )
    redis_warm_connections: int = Field(
        256,
        ge=0,
        description="connections opened at start (at most redis_max_connections), so that a burst of "
        "first turns does not open them all at once",
    )
    redis_connect_concurrency: int = Field(
        16,
        ge=1,
        description="new Redis connections being opened at once per process; a call waits its turn (at most "
        "one timeouts.redis_connect_s per round of openings ahead of it, then it runs without state: busy)",
    )
    redis_in_flight_ttl_s: float = Field(
        60.0,
        gt=0,
        description="how long a claimed conversation stays "
        "in flight if its turn never stores or releases (a crashed gateway)",
    )
    redis_tls_ca_certs: str | None = Field(None, description="CA bundle for rediss:// (default: the system's)")
    redis_tls_certfile: str | None = Field(None, description="client certificate for rediss://")
    redis_tls_keyfile: str | None = Field(None, description="client key for rediss://")
    redis_tls_cert_reqs: str = Field(
        "required", pattern="^(required|optional|none)$", description="verification of the server's certificate"
    )
    redis_tls_check_hostname: bool = Field(True, description="check the server certificate's host name")
    host: str = Field("127.0.0.1", description="address the gateway listens on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="port the gateway listens on")
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="gateway processes sharing the port; more than one "
        "needs redis_url, where they share conversation state",
    )
    models: list[str] = Field(default_factory=list, description="served model names; empty: ask the engines")
    session_headers: list[str] = Field(
        default_factory=lambda: ["x-session-id"], description="headers that carry a conversation id, first wins"
    )
    tenant_header: str | None = Field(
        None,
        description="header naming the tenant, honoured only from a trusted "
        "proxy (trusted_proxy_secret); default: the API key's tenant",
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="gateway API keys, as key-file lines (TURNKV_API_KEYS: separated by "
        "commas or newlines); with any key or key file, every request needs one",
    )
    api_keys_file: str | None = Field(
        None,
        description="file of gateway API keys: one 'sha256:<hex> <tenant>' or "
        "'<plain key> [tenant]' a line, '#' comments; read at start",
    )
    admin_tenants: list[str] = Field(
        default_factory=lambda: ["admin"],
        description="tenants whose keys may read /metrics and /ready's engine details when keys are configured",
    )
    trusted_proxy_secret: SecretStr | None = Field(
        None, description="a proxy that sends this secret in trusted_proxy_header is trusted to name the tenant"
    )
    trusted_proxy_header: str = Field("x-turnkv-proxy-secret", description="header carrying the proxy's secret")
    allow_anonymous: bool = Field(
        False,
        description="serve unauthenticated clients even though upstream_api_key "
        "gives the gateway the engines' credentials",
    )
    decision_headers: Literal["basic", "full"] = Field(
        "basic",
        description="basic: x-turnkv-outcome/action/reason; full: also token counts and prefill time, "
        "which tell a client about the engines' caches (docs/security.md)",
    )
    limits: Limits = Field(default_factory=Limits, description="what one client may hold at the edge")
    cors: Cors = Field(default_factory=Cors, description="browser access")
    max_session_id_length: int = Field(256, ge=8, le=4096, description="longest conversation id a client may send")
    conversation_from_history: bool = Field(
        True,
        description="a request that names no conversation (no header, "
        "body id, previous_response_id, prompt_cache_key or metadata id) is "
        "matched to one by a digest of its messages (gateway/identity.py)",
    )
    response_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="how long /v1/responses keeps a response for "
        "previous_response_id and GET (store: false keeps none)",
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest request body; larger: 413")
    block_size: int = Field(16, ge=1, description="the engines' --block-size")
    decoder_kv_blocks_ttl: float = Field(480.0, gt=0, description="the engines' decoder_kv_blocks_ttl")
    expiry_margin_s: float = Field(10.0, ge=0, description="forget a handle this long before P would decline it")
    kv_bytes_per_token: int = Field(147456, ge=1, description="KV bytes per token (Qwen3-8B bf16 by default)")
    decode_local_direct: bool = Field(
        True,
        description="send a decode-local turn to D without rendering it "
        "first, when the template keeps history and the last answer is echoed as is",
    )
    render_ahead: bool = Field(
        True,
        description="plan a pull or recompute turn from the stored record when the template keeps history and "
        "the history is the stored one, and send P the messages before the render returns; the token check "
        "still runs on the render, beside P's leg, and gates D (gateway/turn/ahead.py)",
    )
    ahead_check: Literal["prefill", "render"] = Field(
        "prefill",
        description="what the token check of a pull sent to P ahead of it runs on: 'prefill': the prompt ids P "
        "computed from, returned with P's answer (return_token_ids; no render call; checked once P answers, "
        "before D starts); 'render': a render call sent beside P's leg (gateway/turn/ahead.py)",
    )
    release_unused: bool = Field(
        True,
        description="release D handles nobody will use (stateless turns...) at "
        "the cost of a 1-token request to a prefill engine",
    )
    decode_memory: DecodeMemory = Field(default_factory=DecodeMemory, description="decode KV pinned by handles")
    write_back: WriteBackSettings = Field(
        default_factory=WriteBackSettings, description="D's KV handed to P's prefix cache after a turn"
    )
    drain_s: float = Field(
        30.0, ge=0, description="on SIGTERM: how long in-flight turns may finish; the rest end with an error event"
    )
    shutdown_delay_s: float = Field(
        0.0,
        ge=0,
        description="on SIGTERM: how long /ready says false while requests "
        "are still served, before new connections are refused",
    )
    upstream_api_key: str | None = Field(None, description="bearer token for the engines; default: the client's")
    allow_client_kv_transfer_params: bool = Field(False, description="let clients send kv_transfer_params")
    engine_fields: list[str] = Field(
        default_factory=list,
        description="request fields clients may send to the engines beyond the allow-list (docs/security.md): "
        "engine-private ones (priority, request_id, vllm_xargs, ec_transfer_params, logits_processors) or a newer "
        "vLLM's own; the rest are refused with a 400 naming the field",
    )
    routing: str = Field(
        "affinity",
        description="the routing profile: affinity (the engines that hold the "
        "conversation, unless much busier), load-affinity (P by the turn's estimated wait there, its "
        "cache counted; D as affinity), least-loaded, round-robin, or one of routing_profiles",
    )
    routing_profiles: dict[str, RoutingProfile] = Field(
        default_factory=dict, description="routing profiles of one's own, by name"
    )
    policy: PolicySettings = Field(default_factory=PolicySettings, description="the reuse policy")
    shared_gpu: bool | Literal["auto"] = Field(
        "auto",
        description="P and D run on the same GPU(s) (two engines splitting one device): P's prefills slow D's "
        "steps as D's own do, which the adaptive policy's ITL checks then weigh (docs/load.md). "
        "auto: where both engines say which GPUs they compute on (turnkv's vLLM plugin), whether any is the "
        "same; otherwise false",
    )
    costs: CostPriors = Field(default_factory=CostPriors, description="the cost model's priors")
    profile: str | None = Field(
        None,
        description="a profile turnkv doctor wrote (--profile FILE): the link and compute figures it measured are "
        "the cost model's priors, in place of costs:'s (read at start; /ready shows them)",
    )
    timeouts: Timeouts = Field(default_factory=Timeouts, description="per engine and Redis call")
    health_interval_s: float = Field(2.0, gt=0, description="how often each engine's health is probed")
    scrape_interval_s: float = Field(5.0, gt=0, description="how often engine /metrics are read")
    store_retry_s: float = Field(
        1.0,
        gt=0,
        description="once Redis counts as down (store_breaker), skip it this long, then let one call probe it; "
        "meanwhile ping it this often (an answer brings it back without a call)",
    )
    store_breaker: StoreBreaker = Field(default_factory=StoreBreaker, description="when Redis counts as down")
    max_connections: int = Field(1024, ge=1, description="open connections to the engines, per gateway process")
    engine_keep_alive_s: float = Field(
        4.0,
        gt=0,
        description="an idle connection to an engine is reused only within this. Below vLLM's own keep-alive "
        "(VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a connection the engine is closing is never sent a request",
    )
    template_audit: bool = Field(True, description="classify the model's chat template at start (/ready)")
    log_level: str = Field("info", description="debug, info, warning or error")
    log_json: bool = Field(True, description="one JSON object a log line; false: plain text")
    _measured: Profile | None = PrivateAttr(None)

    @field_validator("prefill", "decode", mode="after")
    @classmethod
    def _strip_slash(cls, urls: list[str]) -> list[str]:
        return [u.rstrip("/") for u in urls]

    @field_validator("session_headers", mode="after")
    @classmethod
    def _lower(cls, names: list[str]) -> list[str]:
        return [n.lower() for n in names]

    @field_validator("tenant_header", "trusted_proxy_header", mode="after")
    @classmethod
    def _lower_one(cls, name: str | None) -> str | None:
        return name.lower() if name else name

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):  # TURNKV_API_KEYS
            return [k.strip() for k in value.replace("\n", ",").split(",") if k.strip()]
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.prefill or not self.decode:
            raise ConfigError("at least one --prefill and one --decode URL are needed")
        if self.redis_url:
            try:
                parse_redis_url(self.redis_url)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        if self.workers > 1 and not self.redis_url:
            raise ConfigError(
                "--workers above 1 needs --redis-url: each worker is a process of its own, and a "
                "conversation's next turn may reach any of them"
            )
        if self.decoder_kv_blocks_ttl - 5.0 - self.expiry_margin_s <= 0:
            raise ConfigError("decoder_kv_blocks_ttl must exceed 5 s (vLLM's expiry margin) + expiry_margin_s")
        for url in [*self.prefill, *self.decode, *([self.render] if self.render else [])]:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL {url!r} must start with http:// or https://")
        if self.tenant_header and self.trusted_proxy_secret is None:
            raise ConfigError(
                "tenant_header is a client's word unless a trusted proxy proves itself: set "
                "trusted_proxy_secret (and have the proxy send it in trusted_proxy_header)"
            )
        if self.upstream_api_key and not self.auth_configured and not self.allow_anonymous:
            raise ConfigError(
                "upstream_api_key lets the gateway use the engines' credentials, but no gateway "
                "API keys (api_keys, api_keys_file) or trusted proxy are configured: anyone could "
                "use them. Configure keys, or set allow_anonymous to accept that"
            )
        from turnkv.api_keys import load_keys  # the key file is read, and refused if malformed, at start

        load_keys(self)
        build_profile(self.routing, self.routing_profiles)  # so is the routing profile
        if self.profile is not None:
            from turnkv.profile import load_profile  # the doctor's profile is read, and refused if unusable, at start

            try:
                self._measured = load_profile(self.profile)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        return self

    @property
    def measured(self) -> Profile | None:
        """The doctor's profile the ``profile`` setting names, as read at start."""
        return self._measured

    @property
    def auth_configured(self) -> bool:
        """Clients must authenticate: with an API key, or through the trusted proxy."""
        return bool(self.api_keys or self.api_keys_file or self.trusted_proxy_secret)

    @property
    def handle_ttl_s(self) -> float:
        """How long a stored handle may be used: below D's TTL by vLLM's 5 s margin and ours."""
        return self.decoder_kv_blocks_ttl - 5.0 - self.expiry_margin_s


def load_settings(config_file: str | None = None, **flags: Any) -> Settings:
    """Defaults < YAML file < environment < ``flags`` (flags set to None are ignored)."""
    if config_file and not Path(config_file).is_file():
        raise ConfigError(f"config file {config_file} does not exist")

    class _Sources(Settings):
        model_config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": config_file})

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)

    try:
        loaded = _Sources(**{k: v for k, v in flags.items() if v is not None})
        return Settings.model_validate(loaded.model_dump())
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
