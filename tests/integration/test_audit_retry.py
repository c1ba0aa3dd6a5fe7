"""The gateway's chat-template audit keeps trying until the engines answer, however late they start.

vLLM can take many minutes to load a model, and compose or an orchestrator may start the gateway first.
The audit used to give up after 30 attempts and leave the template ``unknown`` until a restart.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.integration.cluster import wait_for
from turnkv import launch
from turnkv.config import Settings
from turnkv.gateway import app as gateway_app

pytestmark = pytest.mark.integration

OLD_LIMIT = 30  # attempts before the audit gave up


class LateEngine:
    """An engine still starting (503 to everything, as vLLM's server before the model is loaded) until
    ``up(url)``; from then on it forwards every request to ``url``, a real (simulated) engine."""

    def __init__(self) -> None:
        self.models_asked = 0
        self.target: str | None = None
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                engine.answer(self)

            def do_POST(self) -> None:
                engine.answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def up(self, url: str) -> None:
        self.target = url

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("content-length") or 0))
        if h.path == "/v1/models":
            self.models_asked += 1
        status, data = 503, json.dumps({"error": {"message": "loading"}}).encode()
        if self.target is not None:
            req = urllib.request.Request(
                self.target + h.path,
                data=body if h.command == "POST" else None,
                method=h.command,
                headers={"content-type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, data = r.status, r.read()
            except urllib.error.HTTPError as exc:
                status, data = exc.code, exc.read()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def late() -> Iterator[tuple[LateEngine, LateEngine]]:
    engines = LateEngine(), LateEngine()  # P and D (the registry needs one URL per instance)
    yield engines
    for e in engines:
        e.close()


def test_the_audit_outlasts_engines_that_start_late(
    procs: list[launch.Running], tmp_path: Path, late: tuple[LateEngine, LateEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # short waits between attempts, so that many attempts fit in a test; the loop is the gateway's own
    monkeypatch.setattr(gateway_app, "AUDIT_FIRST_WAIT_S", 0.01)
    monkeypatch.setattr(gateway_app, "AUDIT_MAX_WAIT_S", 0.05)
    engine = launch.sim("engine", "colocated", "--time-scale", "0", log_dir=tmp_path)
    procs.append(engine)
    p, d = late
    settings = Settings(prefill=[p.url], decode=[d.url], health_interval_s=0.2)
    with TestClient(gateway_app.create_app(settings)) as client:
        wait_for(
            lambda: p.models_asked > OLD_LIMIT,
            timeout_s=60,
            what=f"more than {OLD_LIMIT} audit attempts while the engines are starting",
        )
        assert client.get("/ready").json()["template"]["class"] == "unknown"
        p.up(engine.url)
        d.up(engine.url)
        wait_for(
            lambda: client.get("/ready").json()["template"]["class"] == "preserves",
            timeout_s=60,
            what="the audit once the engine is up",
        )
