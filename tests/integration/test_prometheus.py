"""The observe profile's Prometheus for real: Debian's ``prometheus`` with deploy/prometheus.host.yml and
deploy/alerts, scraping a real gateway that has API keys (with the operator's key from a file, as compose
mounts it), fires each failure alert on the first failure of its kind.

Runs where a ``prometheus`` binary is installed (scripts/test unpacks it from the distribution's package,
beside promtool); skipped, saying so, elsewhere. Only the paths and intervals of the config are changed.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.cluster import Cluster, Dialogue, sim_control, start_cluster, wait_for
from turnkv import launch
from turnkv.api_keys import key_digest
from turnkv.bench.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
OPS_KEY, CLIENT_KEY = "sk-ops-prometheus", "sk-client"
WAIT_S = 60.0


class Prometheus:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc, self.url = proc, url

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return json.loads(r.read())["data"]

    def firing(self, alert: str) -> list[dict[str, str]]:
        return [a["labels"] for a in self.get("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == alert]


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("prometheus is not installed (Debian/Ubuntu: the prometheus package; scripts/test unpacks it)")
    return path


@contextlib.contextmanager
def start_prometheus(binary: str, gateway_url: str, work: Path) -> Iterator[Prometheus]:
    (work / "rules").mkdir()
    (work / "rules" / "turnkv.rules.yml").write_text((ROOT / "deploy/alerts/turnkv.rules.yml").read_text())
    (work / "metrics_key").write_text(OPS_KEY + "\n")
    config = (ROOT / "deploy/prometheus.host.yml").read_text()
    for a, b in (
        ("/etc/prometheus/rules/*.yml", str(work / "rules" / "*.yml")),
        ("/run/secrets/turnkv_metrics_key", str(work / "metrics_key")),
        ("127.0.0.1:8000", gateway_url.removeprefix("http://")),
        ("scrape_interval: 10s", "scrape_interval: 1s"),
        ("evaluation_interval: 10s", "evaluation_interval: 1s"),
    ):
        assert a in config, a
        config = config.replace(a, b)
    (work / "prometheus.yml").write_text(config)
    log = work / "prometheus.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                "--web.listen-address=127.0.0.1:0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        found: list[str] = []

        def listening() -> bool:
            found[:] = re.findall(r"Listening on.*address=127\.0\.0\.1:(\d+)", log.read_text())
            return bool(found) or proc.poll() is not None

        wait_for(listening, WAIT_S, "prometheus to listen")
        assert found, log.read_text()[-2000:]
        url = f"http://127.0.0.1:{found[0]}"

        def ready() -> bool:  # 503 until its storage is open
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=5) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for(ready, WAIT_S, "prometheus to be ready")
        yield Prometheus(proc, url)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_prometheus_scrapes_with_the_key_and_alerts_on_each_first_failure(
    procs: list[launch.Running], tmp_path: Path, own_redis: RedisServer, prometheus_binary: str
) -> None:
    keys = tmp_path / "api_keys"
    keys.write_text(f"sha256:{key_digest(CLIENT_KEY)} client\nsha256:{key_digest(OPS_KEY)} admin\n")
    env = {"TURNKV_API_KEYS_FILE": str(keys), "TURNKV_STORE_RETRY_S": "0.05"}
    c: Cluster = start_cluster(procs, tmp_path, redis_url=own_redis.url, gateway_env=env)
    p = c.prefill[0].url
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    with start_prometheus(prometheus_binary, c.gateway.url, prom_dir) as prom:

        def gateway_target() -> list[dict[str, Any]]:
            return [t for t in prom.get("/api/v1/targets")["activeTargets"] if t["labels"]["job"] == "turnkv"]

        wait_for(lambda: any(t["health"] == "up" for t in gateway_target()), WAIT_S, "the scrape", gateway_target)
        groups = prom.get("/api/v1/rules")["groups"]
        assert sum(len(g["rules"]) for g in groups) >= 16 and {r["health"] for g in groups for r in g["rules"]} == {
            "ok"
        }
        with Dialogue(c, api_key=CLIENT_KEY) as d:
            d.step(truth=False)
            # the scrape above read every counter at 0: the next failure is an increase from there
            assert not prom.firing("TurnkvUpstreamErrors") and not prom.firing("TurnkvStoreUnreachable")

            sim_control(p, fail_next=1)  # one 500 from P
            with contextlib.suppress(openai.APIError):
                d.step(truth=False)
            wait_for(lambda: prom.firing("TurnkvUpstreamErrors"), WAIT_S, "TurnkvUpstreamErrors")
            (fired,) = prom.firing("TurnkvUpstreamErrors")
            assert (fired["engine"], fired["leg"], fired["kind"]) == (p, "prefill", "status")

            own_redis.stop()  # Redis gone: one turn meets it
            d.step(truth=False)
            for alert in ("TurnkvStoreUnreachable", "TurnkvStoreBreakerOpen", "TurnkvReuseFailures"):
                wait_for(lambda a=alert: prom.firing(a), WAIT_S, alert)
            own_redis.start()
