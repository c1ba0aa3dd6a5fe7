"""The gateway's settings: one frozen tree, filled from defaults, a YAML file, ``TURNKV_*`` env and flags.

Precedence, lowest first: defaults, ``--config`` YAML, environment (``TURNKV_PREFILL='["http://..."]'``,
``TURNKV_TIMEOUTS__CONNECT_S=1``), command-line flags. Cross-field checks run at start and fail loudly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from turnkv.state.redis_url import parse_redis_url


class ConfigError(ValueError):
    """A setting is missing or inconsistent; raised at start, never at request time."""


class Timeouts(BaseModel):
    model_config = ConfigDict(frozen=True)
    connect_s: float = Field(2.0, gt=0, description="TCP connect to an engine")
    render_s: float = Field(30.0, gt=0, description="whole render call")
    prefill_s: float = Field(300.0, gt=0, description="whole prefill call, KV pull included")
    decode_read_s: float = Field(300.0, gt=0, description="longest silence between two decode chunks")
    health_s: float = Field(1.0, gt=0)
    redis_s: float = Field(0.25, gt=0, description="one Redis command; past it the turn runs without state")


class PolicySettings(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str = Field("adaptive", description="adaptive | always-pull | never-pull | decode-local")
    params: dict[str, Any] = Field(default_factory=dict, description="the policy's own parameters")


class CostPriors(BaseModel):
    """What the cost model assumes until it has measured the engines (the project's H200 host)."""

    model_config = ConfigDict(frozen=True)
    link_fixed_ms: float = Field(2.0, ge=0)
    link_gbps: float = Field(0.43, gt=0, description="KV transfer bandwidth D -> P (pulls), GB/s")
    push_link_fixed_ms: float | None = Field(None, ge=0, description="P -> D; default: as D -> P")
    push_link_gbps: float | None = Field(None, gt=0, description="P -> D bandwidth, GB/s; default: as D -> P")
    prefill_us_per_token: float = Field(25.0, ge=0)
    prefill_attn_ns: float = Field(1.2, ge=0, description="per new token per token of context")
    prefill_floor_ms: float = Field(10.0, ge=0)
    hop_ms: float = Field(3.0, ge=0)
    recompute_threshold: int = Field(64, ge=0, description="the engines' kv_recompute_threshold")


class Settings(BaseSettings):
    """Everything ``turnkv serve`` needs. See README.md for each field's meaning."""

    model_config = SettingsConfigDict(env_prefix="TURNKV_", env_nested_delimiter="__", frozen=True,
                                      extra="forbid")

    prefill: list[str] = Field(default_factory=list, description="prefill engine base URLs")
    decode: list[str] = Field(default_factory=list, description="decode engine base URLs")
    render: str | None = Field(None, description="render service URL; default: a prefill engine")
    redis_url: str | None = Field(None, description="redis://host:port/db, rediss:// (TLS), unix://, "
                                  "redis+sentinel://host:port[,host:port]/service[/db], "
                                  "redis+cluster://host:port[,host:port]; none: in-process store")
    redis_namespace: str = Field("turnkv", pattern=r"^[^{}]+$", description="prefix of every key turnkv writes")
    redis_max_connections: int = Field(256, ge=1, le=10_000, description="store operations in flight at once "
                                       "per gateway process (each holds one connection per Redis node)")
    redis_pool_timeout_s: float = Field(0.5, gt=0, description="longest wait for a free connection; past it "
                                        "that call runs without state (Redis is not marked down)")
    redis_in_flight_ttl_s: float = Field(60.0, gt=0, description="how long a claimed conversation stays "
                                         "in flight if its turn never stores or releases (a crashed gateway)")
    redis_tls_ca_certs: str | None = Field(None, description="CA bundle for rediss:// (default: the system's)")
    redis_tls_certfile: str | None = Field(None, description="client certificate for rediss://")
    redis_tls_keyfile: str | None = Field(None, description="client key for rediss://")
    redis_tls_cert_reqs: str = Field("required", pattern="^(required|optional|none)$",
                                     description="verification of the server's certificate")
    redis_tls_check_hostname: bool = Field(True, description="check the server certificate's host name")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=256, description="gateway processes sharing the port; more than one "
                         "needs redis_url, where they share conversation state")
    models: list[str] = Field(default_factory=list, description="served model names; empty: ask the engines")
    session_headers: list[str] = Field(default_factory=lambda: ["x-session-id"],
                                       description="headers that carry a conversation id, first wins")
    tenant_header: str | None = Field(None, description="header naming the tenant; default: hash of the API key")
    max_session_id_length: int = Field(256, ge=8, le=4096)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    block_size: int = Field(16, ge=1, description="the engines' --block-size")
    decoder_kv_blocks_ttl: float = Field(480.0, gt=0, description="the engines' decoder_kv_blocks_ttl")
    expiry_margin_s: float = Field(10.0, ge=0, description="forget a handle this long before P would decline it")
    kv_bytes_per_token: int = Field(147456, ge=1, description="KV bytes per token (Qwen3-8B bf16 by default)")
    decode_local_direct: bool = Field(True, description="send a decode-local turn to D without rendering it "
                                      "first, when the template keeps history and the last answer is echoed as is")
    release_unused: bool = Field(True, description="release D handles nobody will use (stateless turns...) at "
                                 "the cost of a 1-token request to a prefill engine")
    release_above_kv_usage: float = Field(0.95, ge=0, le=1.01,
                                          description="release new handles while D's KV cache is fuller than this")
    upstream_api_key: str | None = Field(None, description="bearer token for the engines; default: the client's")
    allow_client_kv_transfer_params: bool = Field(False, description="let clients send kv_transfer_params")
    routing: str = Field("affinity", pattern="^(affinity|least-loaded|round-robin)$",
                         description="affinity: the engines that hold the conversation, unless much busier")
    policy: PolicySettings = Field(default_factory=PolicySettings)
    costs: CostPriors = Field(default_factory=CostPriors)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    health_interval_s: float = Field(2.0, gt=0)
    scrape_interval_s: float = Field(5.0, gt=0, description="how often engine /metrics are read")
    store_retry_s: float = Field(2.0, gt=0, description="after a Redis failure, skip Redis this long")
    max_connections: int = Field(1024, ge=1)
    template_audit: bool = True
    log_level: str = "info"
    log_json: bool = True

    @field_validator("prefill", "decode", mode="after")
    @classmethod
    def _strip_slash(cls, urls: list[str]) -> list[str]:
        return [u.rstrip("/") for u in urls]

    @field_validator("session_headers", mode="after")
    @classmethod
    def _lower(cls, names: list[str]) -> list[str]:
        return [n.lower() for n in names]

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
            raise ConfigError("--workers above 1 needs --redis-url: each worker is a process of its own, and a "
                              "conversation's next turn may reach any of them")
        if self.decoder_kv_blocks_ttl - 5.0 - self.expiry_margin_s <= 0:
            raise ConfigError("decoder_kv_blocks_ttl must exceed 5 s (vLLM's expiry margin) + expiry_margin_s")
        for url in [*self.prefill, *self.decode, *([self.render] if self.render else [])]:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL {url!r} must start with http:// or https://")
        return self

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
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)

    try:
        loaded = _Sources(**{k: v for k, v in flags.items() if v is not None})
        return Settings.model_validate(loaded.model_dump())
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
