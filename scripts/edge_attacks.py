"""What hostile clients cost a gateway: each attack against a fresh gateway on simulated engines, with normal
turns sent meanwhile from another address; prints one JSON object per attack.

    python scripts/edge_attacks.py [--attack headers|uploads|idle ...] [--gateway-src PATH]

headers: 400 connections from 127.0.0.2, each sending up to 4 MiB of one header that never ends; the
gateway's RSS before, at its highest while they send, and after.
uploads: 1,100 connections from 127.0.0.2, each sending the head of a POST with Content-Length 2000 and
one byte of its body, then nothing; 30 turns sent one after another from 127.0.0.1 meanwhile.
idle: 8,400 connections from 127.0.0.2 that send nothing (the header deadline raised to 300 s, so that
they stay); then /health and 10 turns from 127.0.0.1.
For each attack: the turns served, failed (status or error) and their latency (median, max).

``--gateway-src`` runs the gateway from another checkout's ``src`` (``PYTHONPATH``), to compare commits on
the same engines and client. Needs an open-file hard limit above 9,000 (for ``idle``).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from turnkv import launch

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Plan a short trip."}], "max_tokens": 16}
SIM = ("--time-scale", "0", "--vllm-compat", "0.33")
ATTACKER = "127.0.0.2"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Peak(threading.Thread):
    """The highest RSS of a process while it runs (sampled every 50 ms)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, rss_mib(self.pid))


def turns(url: str, n: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """``n`` non-streamed turns one after another (each a new conversation); what became of them."""
    lat: list[float] = []
    failed: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=timeout_s) as c:
        for i in range(n):
            t0 = time.perf_counter()
            try:
                r = c.post("/v1/chat/completions", json={**CHAT, "user": f"u{i}"})
                ok, why = r.status_code == 200, str(r.status_code)
            except httpx.HTTPError as exc:
                ok, why = False, type(exc).__name__
            if ok:
                lat.append(time.perf_counter() - t0)
            else:
                failed[why] = failed.get(why, 0) + 1
    return {
        "sent": n,
        "served": len(lat),
        "failed": failed,
        "latency_ms_median": round(statistics.median(lat) * 1e3, 1) if lat else None,
        "latency_ms_max": round(max(lat) * 1e3, 1) if lat else None,
    }


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(ATTACKER, 0))


def headers_attack(port: int, pid: int) -> dict[str, Any]:
    peak = Peak(pid)
    peak.start()
    conns, sent = [], 0
    chunk = b"a" * 65536
    for _ in range(400):
        s = connect(port)
        conns.append(s)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nX-Big: ")
        s.settimeout(2.0)
        for _ in range(64):
            try:
                s.sendall(chunk)
            except OSError:  # reset, or a full buffer the gateway stopped reading: it is done with this one
                break
            sent += len(chunk)
    time.sleep(1.0)  # let the gateway take what is buffered
    peak.stop.set()
    peak.join()
    for s in conns:
        s.close()
    return {"connections": 400, "mib_taken_by_sockets": round(sent / 2**20), "rss_mib_peak": round(peak.peak)}


def uploads_attack(port: int, url: str) -> dict[str, Any]:
    conns = []
    for _ in range(1100):
        s = connect(port)
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2000\r\n\r\n{"
        )
        conns.append(s)
    out = {"stalled": 1100, "turns": turns(url, 30)}
    for s in conns:
        s.close()
    return out


def idle_attack(port: int, url: str) -> dict[str, Any]:
    conns, refused = [], 0
    for _ in range(8400):
        try:
            conns.append(connect(port))
        except OSError:
            refused += 1
    with httpx.Client(base_url=url, timeout=30) as c:
        try:
            health: Any = c.get("/health").status_code
        except httpx.HTTPError as exc:
            health = type(exc).__name__
    out = {"idle": 8400, "connect_failed": refused, "health": health, "turns": turns(url, 10)}
    for s in conns:
        s.close()
    return out


def run(attack: str, gateway_src: str | None, log_dir: Path) -> dict[str, Any]:
    procs: list[launch.Running] = []
    try:
        p = launch.sim("prefill", "prefill", *SIM, log_dir=log_dir)
        procs.append(p)
        d = launch.sim("decode", "decode", *SIM, log_dir=log_dir)
        procs.append(d)
        env = {"PYTHONPATH": gateway_src} if gateway_src else {}
        if attack == "idle":  # idle sockets stay (the header deadline would close them while more are opened)
            env["TURNKV_LIMITS__HEADER_TIMEOUT_S"] = "300"
        gw = launch.gateway("gateway", [p.url], [d.url], "--log-level", "warning", log_dir=log_dir, env=env)
        procs.append(gw)
        port = int(gw.url.rsplit(":", 1)[1])
        warm = turns(gw.url, 3)
        out: dict[str, Any] = {"attack": attack, "rss_mib_before": round(rss_mib(gw.proc.pid)), "warm": warm}
        if attack == "headers":
            out |= headers_attack(port, gw.proc.pid)
            out["turns"] = turns(gw.url, 10)
        elif attack == "uploads":
            out |= uploads_attack(port, gw.url)
        else:
            out |= idle_attack(port, gw.url)
        out["rss_mib_after"] = round(rss_mib(gw.proc.pid))
        return out
    finally:
        for proc in reversed(procs):
            proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attack", action="append", choices=["headers", "uploads", "idle"])
    ap.add_argument("--gateway-src", default=None, help="run the gateway from this checkout's src")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="edge-attacks-") as tmp:
        for attack in args.attack or ["headers", "uploads", "idle"]:
            print(json.dumps(run(attack, args.gateway_src, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
