"""The checks of scripts/compose-smoke, once a Docker engine, Compose v2 and the base images are there.

Brings the sim profile up (host networking, loopback only, or compose's default network), runs a
five-turn conversation through the openai SDK and expects reuse on turns 2-5, restarts the gateway
and expects the conversation to go on with reuse, restarts it again with 8 streams in flight and
expects each to end with [DONE] (or the documented shutting_down event) with its record written and no
pin left behind, stops Redis and expects a degraded but answered turn, starts it again and expects reuse
back, then takes everything down (volumes too). Every docker call and every wait has a deadline; the
first failed check stops the run with the services' logs. The keys are those of scripts/compose-secrets
(the gateway runs with API keys, as compose configures it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import openai
from openai.types.chat import ChatCompletionChunk

PROJECT = "turnkv-smoke"
REUSE = {"full", "decode_local"}
DEGRADED = {"store_unavailable", "no_record"}
UP_TIMEOUT_S = 300
HEALTHY_TIMEOUT_S = 120
RECOVER_TIMEOUT_S = 60
IN_FLIGHT = 8
# an answer this long streams for ~12 s or more from the simulator (8 ms a token, slower batched): past
# Docker's default 10 s stop timeout, within the gateway's 30 s drain
STREAM_TOKENS = 1500
STREAM_TIMEOUT_S = 120
HOST_PORTS = {
    "GATEWAY_PORT": 8000,
    "PREFILL_PORT": 8100,
    "DECODE_PORT": 8200,
    "REDIS_PORT": 6379,
    "PREFILL_SIDE_PORT": 5600,
    "DECODE_SIDE_PORT": 5601,
}


class SmokeFailed(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def any_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Compose:
    def __init__(self, network: str, env: dict[str, str]) -> None:
        files = ["docker-compose.yml", *(["docker-compose.host.yml"] if network == "host" else [])]
        self.base = ["docker", "compose", "-p", PROJECT, *(a for f in files for a in ("-f", f)), "--profile", "sim"]
        self.env = {**os.environ, **env}
        self.decode_port = self.env.get("DECODE_PORT", "8200") if network == "host" else "8200"

    def run(self, *args: str, timeout_s: float = 120, check: bool = True) -> str:
        cmd = [*self.base, *args]
        try:
            out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise SmokeFailed(f"`{' '.join(args)}` did not finish within {timeout_s:.0f} s") from exc
        if check and out.returncode != 0:
            raise SmokeFailed(f"`{' '.join(args)}` exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        return out.stdout + out.stderr

    def container(self, service: str) -> str:
        return self.run("ps", "-q", service).strip()

    def health(self, service: str) -> str:
        cid = self.container(service)
        if not cid:
            return "absent"
        out = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Health.Status}}", cid], capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip()

    def wait_healthy(self, service: str, timeout_s: float = HEALTHY_TIMEOUT_S) -> None:
        wait_for(lambda: self.health(service) == "healthy", timeout_s, f"{service} to be healthy")


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, every_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SmokeFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


@dataclass(frozen=True)
class Keys:
    client: str  # a client's API key
    metrics: str  # the operator's: /metrics and /ready's details

    @classmethod
    def read(cls, secrets: Path) -> Keys:
        return cls((secrets / "client_key").read_text().strip(), (secrets / "metrics_key").read_text().strip())


def metric(url: str, name: str, key: str) -> float | None:
    """The sum of a metric's samples (None: /metrics did not answer, or has no such metric)."""
    req = urllib.request.Request(url + "/metrics", headers={"authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    ]
    return sum(values) if values else None


class Conversation:
    """One conversation through the gateway: streamed turns, the answer sent back as received."""

    def __init__(self, url: str, key: str, session: str = "compose-smoke") -> None:
        self.url, self.key, self.session = url, key, session
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": "Plan a short trip."},
        ]
        self.turns = 0

    def turn(self) -> dict[str, str]:
        request: dict[str, Any] = {
            "model": "model",
            "messages": self.messages,
            "max_tokens": 60,
            "stream": True,
            "extra_headers": {"X-Session-ID": self.session},
        }
        raw = self.client.chat.completions.with_raw_response.create(**request)
        content, reasoning = "", ""
        for chunk in cast(openai.Stream[ChatCompletionChunk], raw.parse()):
            if chunk.choices:
                delta = chunk.choices[0].delta.model_dump()
                content += delta.get("content") or ""
                reasoning += delta.get("reasoning") or ""
        if not (content or reasoning):
            raise SmokeFailed(f"turn {self.turns + 1}: empty answer")
        self.answered(content, reasoning)
        h = {k: v for k, v in raw.headers.items() if k.startswith("x-turnkv-")}
        log(
            f"{self.session} turn {self.turns}: outcome={h.get('x-turnkv-outcome')} "
            f"reason={h.get('x-turnkv-reason')} action={h.get('x-turnkv-action')} "
            f"matched={h.get('x-turnkv-matched-tokens', '-')} prompt={h.get('x-turnkv-prompt-tokens', '-')}"
        )
        return h

    def answered(self, content: str, reasoning: str) -> None:
        self.turns += 1
        self.messages += [
            {"role": "assistant", "content": content, "reasoning": reasoning},
            {"role": "user", "content": f"Thanks. Now step {self.turns}, please."},
        ]

    def long_turn(self) -> str:
        """A streamed turn of STREAM_TOKENS tokens, read as raw SSE: "done" when its last event is
        ``[DONE]``, "shutting_down" when it is the gateway's error event of that code, otherwise what
        ended it. A finished answer joins the history."""
        body = {
            "model": "model",
            "messages": self.messages,
            "stream": True,
            "max_tokens": STREAM_TOKENS,
            "min_tokens": STREAM_TOKENS,
        }
        headers = {"authorization": f"Bearer {self.key}", "x-session-id": self.session}
        last, content, reasoning = "", "", ""
        try:
            with (
                httpx.Client(timeout=STREAM_TIMEOUT_S) as http,
                http.stream("POST", self.url + "/v1/chat/completions", json=body, headers=headers) as r,
            ):
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.read().decode()[:200]}"
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    last = line[6:]
                    if last != "[DONE]":
                        event = json.loads(last)
                        for choice in event.get("choices", []):
                            content += choice["delta"].get("content") or ""
                            reasoning += choice["delta"].get("reasoning") or ""
        except httpx.HTTPError as exc:
            return f"cut: {type(exc).__name__}: {exc}"
        if last == "[DONE]":
            self.answered(content, reasoning)
            return "done"
        code = json.loads(last).get("error", {}).get("code") if last.startswith("{") else None
        return "shutting_down" if code == "shutting_down" else f"ended without [DONE]: {last[:200]}"


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise SmokeFailed(what)
    log(f"ok: {what}")


def restart_with_streams_in_flight(compose: Compose, url: str, keys: Keys) -> None:
    """docker compose restart while IN_FLIGHT long streams run: each ends with [DONE] (or shutting_down),
    its record written (its conversation's next turn reuses), and no pin left on D that no record holds."""
    convs = [Conversation(url, keys.client, session=f"in-flight-{i}") for i in range(IN_FLIGHT)]
    for c in convs:
        c.turn()
    ends: dict[str, str] = {}
    threads = [threading.Thread(target=lambda c=c: ends.__setitem__(c.session, c.long_turn())) for c in convs]
    for t in threads:
        t.start()
    wait_for(
        lambda: metric(url, "turnkv_inflight_turns", keys.metrics) == IN_FLIGHT, 30, f"{IN_FLIGHT} turns in flight"
    )
    log(f"restart the gateway with {IN_FLIGHT} streams in flight (docker compose restart turnkv-sim)")
    started = time.monotonic()
    compose.run("restart", "turnkv-sim", timeout_s=120)
    log(f"restart returned after {time.monotonic() - started:.1f} s")
    for t in threads:
        t.join(STREAM_TIMEOUT_S)
    expect(
        all(ends.get(c.session) in ("done", "shutting_down") for c in convs),
        f"every stream in flight ended with [DONE] or shutting_down: {sorted(ends.items())}",
    )
    compose.wait_healthy("turnkv-sim")
    outcomes = [c.turn().get("x-turnkv-outcome") for c in convs if ends[c.session] == "done"]
    expect(all(o in REUSE for o in outcomes), f"each finished stream's record was written: next turns {outcomes}")
    state_url = f"http://127.0.0.1:{compose.decode_port}/_sim/state"
    read = f"import urllib.request; print(urllib.request.urlopen({state_url!r}, timeout=5).read().decode())"
    held = json.loads(compose.run("exec", "-T", "decode-sim", "python3", "-c", read, timeout_s=60).strip())
    pinned_d = int(held["pinned_tokens"])
    pinned_gw = metric(url, "turnkv_pinned_kv_tokens", keys.metrics) or 0
    expect(pinned_d <= pinned_gw, f"D pins no blocks that no record holds (D {pinned_d}, records {pinned_gw:.0f})")


def smoke(compose: Compose, url: str, keys: Keys) -> None:
    log("build (one image, turnkv:local, for the gateway and both engines)")
    out = compose.run("build", timeout_s=900)
    print("\n".join(line for line in out.splitlines() if "Built" in line or "writing image" in line), flush=True)
    log("up --wait (healthchecks: redis, prefill-sim, decode-sim, then turnkv-sim)")
    compose.run("up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S), timeout_s=UP_TIMEOUT_S + 30)
    print(compose.run("ps"), flush=True)
    images = {
        subprocess.run(
            ["docker", "inspect", "-f", "{{.Image}}", compose.container(s)], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        for s in ("prefill-sim", "decode-sim", "turnkv-sim")
    }
    expect(len(images) == 1, f"the gateway and both engines run one image ({', '.join(i[:19] for i in images)})")
    details = urllib.request.Request(url + "/ready", headers={"authorization": f"Bearer {keys.metrics}"})
    with urllib.request.urlopen(details, timeout=10) as r:
        ready = json.loads(r.read())
    log(f"/ready: store={ready['store']} template={ready['template']['class']}")

    conv = Conversation(url, keys.client)
    outcomes = [conv.turn().get("x-turnkv-outcome") for _ in range(5)]
    expect(all(o in REUSE for o in outcomes[1:]), f"turns 2-5 reuse D's KV: {outcomes}")

    log("restart the gateway (docker compose restart turnkv-sim)")
    compose.run("restart", "turnkv-sim", timeout_s=60)
    compose.wait_healthy("turnkv-sim")
    outcome = conv.turn().get("x-turnkv-outcome")
    expect(outcome in REUSE, f"after the gateway's restart the conversation goes on with reuse ({outcome})")

    restart_with_streams_in_flight(compose, url, keys)

    log("stop Redis (docker compose stop redis)")
    compose.run("stop", "redis", timeout_s=60)
    h = conv.turn()
    expect(
        h.get("x-turnkv-reason") in DEGRADED,
        f"with Redis down the turn is answered, plain P/D ({h.get('x-turnkv-outcome')}/{h.get('x-turnkv-reason')})",
    )
    expect(metric(url, "turnkv_store_up", keys.metrics) == 0, "turnkv_store_up is 0")

    log("start Redis again (docker compose start redis)")
    compose.run("start", "redis", timeout_s=60)
    compose.wait_healthy("redis")
    recovered: list[str] = []

    def reused() -> bool:
        h = conv.turn()
        recovered.append(f"{h.get('x-turnkv-outcome')}/{h.get('x-turnkv-reason')}")
        return h.get("x-turnkv-outcome") in REUSE

    # a turn within store_retry_s of the last failure still skips Redis; then reuse is back
    wait_for(reused, RECOVER_TIMEOUT_S, "reuse after Redis came back", every_s=2.0)
    expect(
        metric(url, "turnkv_store_up", keys.metrics) == 1, f"the gateway recovered: reuse again, store up ({recovered})"
    )
    log(f"conversation: {conv.turns} turns")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--network", choices=["host", "default"], default="host")
    ap.add_argument("--log-dir", type=Path, default=Path("/var/tmp/turnkv-compose-smoke"))
    ap.add_argument("--secrets", type=Path, default=Path(os.environ.get("TURNKV_SECRETS_DIR", "secrets")))
    a = ap.parse_args()
    keys = Keys.read(a.secrets)
    env: dict[str, str] = {"TURNKV_SECRETS_DIR": str(a.secrets.resolve())}
    if a.network == "host":
        for name, port in HOST_PORTS.items():
            chosen = int(os.environ.get(name, port))
            if not free(chosen):
                chosen = any_free_port()
                log(f"port {port} is taken on this host: {name}={chosen}")
            env[name] = str(chosen)
    url = f"http://127.0.0.1:{env.get('GATEWAY_PORT', os.environ.get('GATEWAY_PORT', '8000'))}"
    compose = Compose(a.network, env)
    status = 0
    try:
        smoke(compose, url, keys)
        log("PASSED")
    except (SmokeFailed, openai.OpenAIError, OSError) as exc:
        log(f"FAILED: {exc}")
        print(compose.run("logs", "--no-color", "--tail", "40", timeout_s=60, check=False), flush=True)
        status = 1
    finally:
        log("down -v (containers, network, volumes)")
        a.log_dir.mkdir(parents=True, exist_ok=True)
        (a.log_dir / "compose.log").write_text(compose.run("logs", "--no-color", timeout_s=60, check=False))
        compose.run("down", "-v", "--remove-orphans", timeout_s=120, check=False)
        left = compose.run("ps", "-a", "-q", timeout_s=30, check=False).strip()
        if left:
            log(f"containers left behind: {left}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
