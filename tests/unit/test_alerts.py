"""The alert rules (deploy/alerts): promtool accepts them and passes their tests, every alert has a test,
and they ask only for metrics and labels the gateway exports; the gateway exports every counter at 0.

promtool comes from the distribution's ``prometheus`` package (scripts/test installs it); without it the
promtool tests are skipped, saying so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_dashboard import exported, selectors
from turnkv.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "alerts"
RULES = ALERTS / "turnkv.rules.yml"
TESTS = ALERTS / "turnkv.test.yml"
TARGET_LABELS = {"job", "instance", "service", "__name__"}  # Prometheus's, from the scrape config


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian/Ubuntu: the prometheus package; scripts/test installs it)")
    return path


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for group in doc["groups"] for r in group["rules"]]


@pytest.mark.parametrize("args", [("check", "rules", str(RULES)), ("test", "rules", str(TESTS))])
def test_promtool_accepts_the_rules_and_their_tests_pass(args: tuple[str, ...]) -> None:
    out = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=ALERTS)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_every_alert_has_a_test() -> None:
    tested = {t["alertname"] for case in yaml.safe_load(TESTS.read_text())["tests"] for t in case["alert_rule_test"]}
    assert {r["alert"] for r in rules()} == tested


def test_every_rule_asks_for_what_the_gateway_exports() -> None:
    names = exported()
    for rule in rules():
        used = list(selectors(rule["expr"]))
        ours = [m for m, _ in used if m.startswith("turnkv_")]
        for metric, labels in used:
            if metric.startswith("turnkv_"):
                assert metric in names, f"{rule['alert']}: {metric} is not exported by the gateway"
                assert labels - TARGET_LABELS <= names[metric], f"{rule['alert']}: {metric} lacks {labels}"
            elif metric:  # Prometheus's own series, or a label of a selector without a metric name
                assert metric in {"up"} | TARGET_LABELS, f"{rule['alert']}: what is {metric}?"
            elif ours:
                have = set().union(*(names[m] for m in ours)) | TARGET_LABELS
                assert labels <= have, f"{rule['alert']}: grouping by {labels - have}"


def test_every_counter_is_exported_at_zero_from_the_start() -> None:
    """Before any turn: each counter has its series, for the configured engines too, all at 0."""
    m = GatewayMetrics(prefill=["http://p0:8100"], decode=["http://d0:8200", "http://d1:8200"])
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    counters = [f for f in families.values() if f.type == "counter"]
    assert counters
    for f in counters:
        totals = [s for s in f.samples if s.name.endswith("_total")]
        assert totals, f"{f.name} has no series before its first increment"
        assert all(s.value == 0 for s in totals), f.name
    errors = {(s.labels["leg"], s.labels["engine"]) for s in families["turnkv_upstream_errors"].samples}
    assert {("prefill", "http://p0:8100"), ("decode", "http://d1:8200"), ("render", "unknown")} <= errors
    waits = {s.labels["decode"] for s in families["turnkv_decode_admission_waits"].samples}
    assert waits >= {"http://d0:8200", "http://d1:8200"}
    up = {(s.labels["role"], s.labels["engine"]): s.value for s in families["turnkv_engine_up"].samples}
    assert up == {("prefill", "http://p0:8100"): 1, ("decode", "http://d0:8200"): 1, ("decode", "http://d1:8200"): 1}
