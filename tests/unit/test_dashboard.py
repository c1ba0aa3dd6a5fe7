"""The Grafana dashboard (deploy/grafana/dashboards) asks only for metrics, and labels, the gateway exports.

The names come from the gateway itself: ``GatewayMetrics()``'s registry, as Prometheus will see them
(a counter ``x`` is scraped as ``x_total``, a histogram ``x`` as ``x_bucket``, ``x_sum`` and ``x_count``).
The queries are read with a small PromQL tokenizer: enough for what a dashboard uses (selectors,
aggregations with ``by``, functions, arithmetic), and it fails on anything it does not understand.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from turnkv.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))

# Metrics a dashboard may show before the gateway exports them (none now): an entry counts only while
# GatewayMetrics lacks the name; once the gateway exports it, its real labels are checked instead.
PENDING: dict[str, set[str]] = {}

TARGET_LABELS = {"job", "instance"}  # Prometheus gives every scraped series these
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
AGGREGATIONS = {
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "topk",
    "bottomk",
    "quantile",
    "stddev",
    "stdvar",
    "group",
    "count_values",
}
MATCHERS = {"=", "!=", "=~", "!~"}
TOKEN = re.compile(
    r"""
    (?P<space>\s+) | (?P<string>"(?:[^"\\]|\\.)*") | (?P<range>\[[^\]]+\]) | (?P<var>\$\w+)
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?) | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}])
""",
    re.VERBOSE,
)


def exported() -> dict[str, set[str]]:
    """Every series name the gateway's /metrics can show, with its label names."""
    metrics = GatewayMetrics()
    types = {family.name: family.type for family in metrics.registry.collect()}
    labels = {}  # prometheus_client has no public accessor for a metric's label names
    for m in vars(metrics).values():
        if isinstance(m, MetricWrapperBase):
            for family in m.describe():
                labels[family.name] = set(m._labelnames)
    assert set(labels) == set(types), "a metric of the registry that is not an attribute of GatewayMetrics"
    names: dict[str, set[str]] = {}
    for name, kind in types.items():
        for suffix in SUFFIXES[kind]:
            names[name + suffix] = labels[name] | ({"le"} if suffix == "_bucket" else set())
    return names


def engine_metrics() -> dict[str, set[str]]:
    """The engines' vllm:* series as the simulator exports them (vLLM's names and labels), with the
    ``service`` label the scrape config gives each engine (deploy/prometheus.yml)."""
    from turnkv.sim.metrics import EngineMetrics

    names: dict[str, set[str]] = {}
    for family in EngineMetrics("model").registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return {n: ls | {"service"} for n, ls in names.items()}


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos:]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "space":
            out.append((m.lastgroup or "", m.group()))
    return out


def closing(toks: list[tuple[str, str]], start: int, bracket: str) -> int:
    return next(j for j in range(start, len(toks)) if toks[j][1] == bracket)


def selectors(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric, labels it matches on) for each selector, and ("", labels) for each by/on/... list."""
    toks = [*tokens(expr), ("end", "")]
    i = 0
    while i < len(toks) - 1:
        kind, text = toks[i]
        after = toks[i + 1][1]
        if kind != "name" or text in {"bool", "and", "or", "unless", "offset"}:
            i += 1
        elif text in {"by", "without", "on", "ignoring", "group_left", "group_right"}:
            if after != "(":  # group_left alone
                i += 1
                continue
            end = closing(toks, i + 2, ")")
            yield "", {t for k, t in toks[i + 2 : end] if k == "name"}
            i = end + 1
        elif after == "(" or (text in AGGREGATIONS and after in {"by", "without"}):
            if text not in AGGREGATIONS and not re.fullmatch(r"[a-z_]+", text):
                raise ValueError(f"unknown function {text!r} in {expr!r}")
            i += 1  # a function or an aggregation: its arguments follow
        elif after == "{":
            end = closing(toks, i + 2, "}")
            yield text, {toks[j][1] for j in range(i + 2, end) if toks[j + 1][1] in MATCHERS}
            i = end + 1
        else:
            yield text, set()
            i += 1


def queries(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    for p in panels:
        yield from queries(p.get("panels", []))
        for t in p.get("targets", []):
            yield p["title"], t["expr"]


@pytest.fixture(scope="module")
def names() -> dict[str, set[str]]:
    return exported()


def test_the_tokenizer_finds_names_and_labels() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, turn) (rate(turnkv_ttft_seconds_bucket{outcome=~"full|x"}'
        "[$__rate_interval]))) / ignoring(turn) max(turnkv_store_up) == 1"
    )
    assert list(selectors(expr)) == [
        ("", {"le", "turn"}),
        ("turnkv_ttft_seconds_bucket", {"outcome"}),
        ("", {"turn"}),
        ("turnkv_store_up", set()),
    ]
    with pytest.raises(ValueError):
        list(selectors("sum(rate(x[5m])) # a comment"))


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_every_query_names_a_metric_and_labels_the_gateway_exports(path: Path, names: dict[str, set[str]]) -> None:
    known = {**{n: ls for n, ls in PENDING.items() if n not in names}, **names, **engine_metrics()}
    dash = json.loads(path.read_text())
    found = list(queries(dash["panels"]))
    assert found, "a dashboard without queries"
    for title, expr in found:
        used = list(selectors(expr))
        metrics = [m for m, _ in used if m]
        assert metrics, f"{title}: no metric in {expr!r}"
        for metric, labels in used:
            if metric:
                assert metric in known, f"{title}: {metric} is not exported by the gateway ({expr!r})"
                lacking = labels - known[metric] - TARGET_LABELS
                assert not lacking, f"{title}: {metric} has no label {lacking}"
            else:  # by (...): the labels of some metric in the query
                have = set().union(*(known[m] for m in metrics)) | TARGET_LABELS
                assert labels <= have, f"{title}: grouping by {labels - have}, which none of {metrics} has"


def test_the_dashboard_uses_the_provisioned_datasource() -> None:
    provisioned = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    uids = {d["uid"] for d in provisioned}
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for p in dash["panels"]:
            if p["type"] != "row":
                assert p["datasource"]["uid"] in uids, f"{path.name}: {p['title']}"
                assert all(t["datasource"]["uid"] in uids for t in p["targets"]), f"{path.name}: {p['title']}"
