"""docker-compose.yml as an operator meets it: restarts that let turns finish, secrets from files and no
default password, healthchecks on every long-running service, Prometheus scraping with a key and loading
the alert rules. Read as YAML here (no Docker needed); scripts/compose-check asks Docker itself where
one is installed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnkv.config import Settings
from turnkv.launch import GRACE_S

ROOT = Path(__file__).resolve().parents[2]
MARGIN_S = 5.0  # between the gateway's last settling and Docker's SIGKILL


def compose(name: str = "docker-compose.yml") -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / name).read_text())
    return doc


def seconds(value: str) -> float:
    """A compose duration ('45s', '1m30s') or a ${VAR:-default} of one, as its default."""
    m = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
    text = m.group(1) if m else value
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {value}"
    return sum(float(n) * units[u] for n, u in parts)


def default(value: str) -> str:
    m = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
    return m.group(1) if m else value


def gateways(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in doc["services"].items() if s.get("command", [None])[0] == "serve"}


def test_docker_waits_for_the_drain_before_it_kills_a_gateway() -> None:
    doc = compose()
    assert set(gateways(doc)) == {"turnkv-sim", "turnkv"}
    for name, svc in gateways(doc).items():
        env = svc["environment"]
        drain = float(default(env["TURNKV_DRAIN_S"]))
        unset = str(Settings.model_fields["shutdown_delay_s"].default)
        delay = float(default(env.get("TURNKV_SHUTDOWN_DELAY_S", unset)))
        grace = seconds(svc["stop_grace_period"])
        assert grace >= delay + drain + GRACE_S + MARGIN_S, f"{name}: stop_grace_period {grace} s"
        assert grace > 10, "Docker's default stop timeout (10 s) is what cut streams"


def test_secrets_come_from_files_and_nothing_has_a_default_password() -> None:
    doc = compose()
    files = {n: s["file"] for n, s in doc["secrets"].items()}
    assert all(f.startswith("${TURNKV_SECRETS_DIR:-./secrets}/") for f in files.values())
    made = (ROOT / "scripts" / "compose-secrets").read_text()
    for f in files.values():
        assert f.rsplit("/", 1)[1] in made, f"scripts/compose-secrets does not write {f}"
    for name, svc in doc["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            secretish = re.search(r"PASSWORD|TOKEN|SECRET|API_KEY", key) and not key.endswith(
                ("__FILE", "_FILE", "_PATH")
            )
            assert not secretish, f"{name}: {key} in the environment; mount it as a secret file"
            if key.endswith(("__FILE", "_FILE", "_PATH")) and "/run/secrets/" in str(value):
                secret = str(value).rsplit("/", 1)[1]
                assert secret in svc.get("secrets", []), f"{name}: {key} names a secret it does not mount"
    grafana = doc["services"]["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    for svc in gateways(doc).values():
        assert svc["environment"]["TURNKV_API_KEYS_FILE"] == "/run/secrets/turnkv_api_keys"


def test_every_long_running_service_has_a_healthcheck() -> None:
    doc, host = compose(), compose("docker-compose.host.yml")
    for name, svc in doc["services"].items():
        if svc.get("restart") == "no":
            continue  # a run to completion (turnkv doctor): it has no health to check
        assert "healthcheck" in svc or "<<" in svc, name
        check = host["services"].get(name, {}).get("healthcheck") or svc.get("healthcheck")
        assert check is not None and check["test"][0] == "CMD", name


def test_prometheus_scrapes_with_the_operators_key_and_loads_the_alerts() -> None:
    doc = compose()
    prom = doc["services"]["prometheus"]
    assert "turnkv_metrics_key" in prom["secrets"]
    assert any(v.startswith("./deploy/alerts/turnkv.rules.yml:/etc/prometheus/rules/") for v in prom["volumes"])
    for name in ("deploy/prometheus.yml", "deploy/prometheus.host.yml"):
        config = yaml.safe_load((ROOT / name).read_text())
        assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
        job = next(j for j in config["scrape_configs"] if j["job_name"] == "turnkv")
        assert job["authorization"]["credentials_file"] == "/run/secrets/turnkv_metrics_key"


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` as compose lays an override file: mappings merge, other values replace."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.host.yml")])
def test_the_doctor_runs_before_each_gateway_and_seeds_it(files: tuple[str, ...]) -> None:
    # a blocking problem (exit 1) keeps the gateway from starting; what the doctor measured is its priors
    doc: dict[str, Any] = {}
    for name in files:
        doc = merged(doc, compose(name))
    for gw_name, gw in gateways(doc).items():
        doctors = [d for d, c in gw["depends_on"].items() if c["condition"] == "service_completed_successfully"]
        assert len(doctors) == 1, f"{gw_name}: no doctor before it"
        doctor = doc["services"][doctors[0]]
        assert doctor["command"][0] == "doctor" and doctor["restart"] == "no"
        for key in ("TURNKV_PREFILL", "TURNKV_DECODE"):
            assert doctor["environment"][key] == gw["environment"][key], (gw_name, key)
        profile = gw["environment"]["TURNKV_PROFILE"]
        assert doctor["command"][doctor["command"].index("--profile") + 1] == profile
        folder = profile.rsplit("/", 1)[0]
        assert f"doctor:{folder}" in doctor["volumes"] and f"doctor:{folder}:ro" in gw["volumes"]
