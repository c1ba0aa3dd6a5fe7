"""Who a request comes from: bearer parsing, key lines and files, the authenticator's answers, the settings it
refuses at start, the per-tenant cache salt, and the in-flight caps (tables, no I/O but a temporary key file)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from turnkv.api_keys import KeyFileError, key_digest, parse_key_line, parse_keys
from turnkv.config import ConfigError, Settings, load_settings
from turnkv.errors import ClientError, Forbidden, Unauthorized
from turnkv.gateway.auth import ANONYMOUS, Authenticator, bearer_token, cache_salt, named_tenant, require_admin

ENGINES: dict[str, Any] = {"prefill": ["http://127.0.0.1:9"], "decode": ["http://127.0.0.1:9"]}
DIGEST_A = hashlib.sha256(b"sk-a").hexdigest()


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("", None),
        ("Bearer sk-1", "sk-1"),
        ("bearer sk-1", "sk-1"),
        ("BEARER  sk-1 ", "sk-1"),
        ("Bearer\tsk-1", "sk-1"),
        ("Bearer", None),
        ("Bearer ", None),
        ("Bearer a b", None),
        ("Basic dXNlcjpwYXNz", None),
        ("sk-1", None),
        ("Bearersk-1", None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        ("", None),
        ("   ", None),
        ("# a comment", None),
        ("sk-a", (DIGEST_A, "key-" + DIGEST_A[:16])),
        ("sk-a acme", (DIGEST_A, "acme")),
        ("  sk-a   acme  ", (DIGEST_A, "acme")),
        (f"sha256:{DIGEST_A} acme", (DIGEST_A, "acme")),
        (f"SHA256:{DIGEST_A.upper()} acme", (DIGEST_A, "acme")),
        (f"sha256:{DIGEST_A}", (DIGEST_A, "key-" + DIGEST_A[:16])),
    ],
)
def test_key_lines(line: str, parsed: tuple[str, str] | None) -> None:
    assert parse_key_line(line) == parsed


@pytest.mark.parametrize(
    "line",
    [
        "sk-a acme extra",
        "sha256:abc acme",
        f"sha256:{DIGEST_A}0 acme",
        f"sha256:{'g' * 64} acme",
        "sk-a ten;ant",
        "sk-a " + "t" * 129,
    ],
)
def test_bad_key_lines(line: str) -> None:
    with pytest.raises(KeyFileError):
        parse_key_line(line)


def test_a_bad_line_is_named_but_not_echoed() -> None:
    with pytest.raises(KeyFileError) as err:
        parse_keys(["sk-good a", "sk-secret-value t1 t2"], "keys.txt")
    assert "keys.txt line 2" in str(err.value) and "sk-secret-value" not in str(err.value)


def test_one_key_for_two_tenants_is_refused() -> None:
    with pytest.raises(KeyFileError):
        parse_keys(["sk-a acme", f"sha256:{DIGEST_A} other"], "keys")
    assert parse_keys(["sk-a acme", f"sha256:{DIGEST_A} acme"], "keys") == {DIGEST_A: "acme"}


def settings(**over: Any) -> Settings:
    return Settings(**{**ENGINES, **over})


def test_keys_file_and_env_list_together(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# tenants\nsha256:{DIGEST_A} acme\nsk-ops admin\n")
    auth = Authenticator(settings(api_keys_file=str(f), api_keys=["sk-b beta", "sk-c"]))
    assert auth.required
    cases = {"sk-a": ("acme", False), "sk-ops": ("admin", True), "sk-b": ("beta", False)}
    for key, (name, admin) in cases.items():
        p = auth.authenticate({"authorization": f"Bearer {key}"})
        assert (p.name, p.tenant, p.admin, p.authenticated) == (name, named_tenant(name), admin, True)
        assert p.forward_authorization is None  # a gateway key is not the engines' business
    c = auth.authenticate({"authorization": "bearer sk-c"})
    assert c.name == "key-" + key_digest("sk-c")[:16] and not c.admin


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer sk-x"},
        {"authorization": "Basic sk-a"},
        {"authorization": "sk-a"},
        {"x-tenant": "acme"},
    ],
)
def test_with_keys_a_missing_or_unknown_key_is_a_401(headers: dict[str, str]) -> None:
    auth = Authenticator(settings(api_keys=["sk-a acme"]))
    with pytest.raises(Unauthorized) as err:
        auth.authenticate(headers)
    assert err.value.status == 401 and err.value.headers() == {"www-authenticate": "Bearer"}


def test_without_keys_tenants_are_hashes_of_the_credential() -> None:
    auth = Authenticator(settings())
    a = auth.authenticate({"authorization": "Bearer k1"})
    assert a.tenant == auth.authenticate({"authorization": "bearer  k1"}).tenant  # the scheme's case is not a tenant
    assert a.tenant != auth.authenticate({"authorization": "Bearer k2"}).tenant
    assert "k1" not in a.tenant and a.forward_authorization == "Bearer k1" and a.admin and not a.authenticated
    assert auth.authenticate({}).tenant == ANONYMOUS
    assert auth.authenticate({"authorization": "Basic x"}).tenant not in (ANONYMOUS, a.tenant)
    assert not auth.required


def proxy_settings(**over: Any) -> Settings:
    return settings(tenant_header="X-Tenant", trusted_proxy_secret="s3cret", **over)


def test_the_tenant_header_needs_the_proxy_secret() -> None:
    auth = Authenticator(proxy_settings(api_keys=["sk-b beta"]))
    via_proxy = auth.authenticate({"x-tenant": "acme", "x-turnkv-proxy-secret": "s3cret"})
    assert via_proxy.tenant == named_tenant("acme") and via_proxy.authenticated
    # the same tenant whether a key or the proxy names it
    assert auth.authenticate({"x-tenant": "beta", "x-turnkv-proxy-secret": "s3cret"}).tenant == named_tenant("beta")
    # a client's own word: the header is ignored, and the key decides
    assert auth.authenticate({"x-tenant": "acme", "authorization": "Bearer sk-b"}).tenant == named_tenant("beta")
    for wrong in (
        {"x-tenant": "acme"},
        {"x-tenant": "acme", "x-turnkv-proxy-secret": "S3CRET"},
        {"x-tenant": "acme", "x-turnkv-proxy-secret": ""},
    ):
        with pytest.raises(Unauthorized):
            auth.authenticate(wrong)
    with pytest.raises(ClientError):
        auth.authenticate({"x-tenant": "a b", "x-turnkv-proxy-secret": "s3cret"})


def test_proxy_only_refuses_direct_clients() -> None:
    auth = Authenticator(proxy_settings())
    assert auth.required
    with pytest.raises(Unauthorized):
        auth.authenticate({"x-tenant": "acme", "authorization": "Bearer anything"})
    assert auth.authenticate({"x-turnkv-proxy-secret": "s3cret"}).tenant == ANONYMOUS


def test_admin_only() -> None:
    auth = Authenticator(settings(api_keys=["sk-a acme", "sk-ops ops"], admin_tenants=["ops"]))
    require_admin(auth.authenticate({"authorization": "Bearer sk-ops"}))
    with pytest.raises(Forbidden):
        require_admin(auth.authenticate({"authorization": "Bearer sk-a"}))
    assert not auth.anonymous().admin
    assert Authenticator(settings()).anonymous().admin  # no keys: as before, everyone is the operator


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"tenant_header": "x-tenant"}, "trusted_proxy_secret"),
        ({"upstream_api_key": "engine-key"}, "allow_anonymous"),
        ({"api_keys": ["sk-a a b"]}, "api_keys line 1"),
        ({"api_keys_file": "/nonexistent/keys"}, "api_keys_file"),
        ({"api_keys": ["sk-a acme", "sk-a beta"]}, "another tenant"),
    ],
)
def test_settings_refused_at_start(over: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        settings(**over)
    assert needle in str(err.value)
    assert "engine-key" not in str(err.value) and "sk-a" not in str(err.value)  # secrets stay out of the message


@pytest.mark.parametrize(
    "over",
    [
        {"upstream_api_key": "k", "allow_anonymous": True},
        {"upstream_api_key": "k", "api_keys": ["sk-a"]},
        {"upstream_api_key": "k", "trusted_proxy_secret": "s"},
        {"tenant_header": "x-tenant", "trusted_proxy_secret": "s"},
    ],
)
def test_settings_accepted(over: dict[str, Any]) -> None:
    settings(**over)


def test_api_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKV_API_KEYS", "sk-a acme, sk-b\nsk-c beta")
    monkeypatch.setenv("TURNKV_DECISION_HEADERS", "full")
    s = load_settings(None, **ENGINES)
    assert [k.get_secret_value() for k in s.api_keys] == ["sk-a acme", "sk-b", "sk-c beta"]
    assert "sk-a" not in repr(s) and s.decision_headers == "full"
    monkeypatch.setenv("TURNKV_UPSTREAM_API_KEY", "engine-secret")
    monkeypatch.setenv("TURNKV_API_KEYS", "")
    with pytest.raises(ConfigError) as err:
        load_settings(None, **ENGINES)
    assert "engine-secret" not in str(err.value)


def test_cache_salt_separates_tenants_and_client_salts() -> None:
    salts = {cache_salt(t, c) for t in ("k:1", "k:2", ANONYMOUS) for c in (None, "x", "y")}
    assert len(salts) == 9
    assert cache_salt("k:1", None) == cache_salt("k:1", None)
    assert cache_salt("k:1", "") == cache_salt("k:1", None)  # vLLM refuses an empty salt; the gateway never sends one
