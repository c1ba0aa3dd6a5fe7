"""``turnkv serve --workers 2``: two gateway processes on one port share conversations and metrics."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.integration.cluster import Cluster, Dialogue, Turn, metric, sim_control, sim_state, start_cluster, wait_for
from turnkv import launch
from turnkv.bench.procs import descendants
from turnkv.bench.redis_server import free_port
from turnkv.gateway import workers

pytestmark = pytest.mark.integration

MAX_TURNS = 40  # connections spread by address over 2 workers: all 40 on one has odds of 2**-39


def workers_of(pid: int) -> set[int]:
    """The gateway's worker processes (spawned; not multiprocessing's resource tracker)."""
    found = set()
    for p in descendants(pid):
        try:
            if b"spawn_main" in (Path("/proc") / str(p) / "cmdline").read_bytes():
                found.add(p)
        except OSError:
            continue  # exited while we looked
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def start(procs: list[launch.Running], tmp_path: Path, redis_url: str) -> Cluster:
    # TMPDIR: the workers' metrics directory lives there (and a killed supervisor leaves it behind)
    return start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        redis_url=redis_url,
        gateway_args=("--workers", "2"),
        gateway_env={"TMPDIR": str(tmp_path)},
    )


def served_by(c: Cluster, count: int) -> list[int]:
    """The worker pid of each of the gateway's turns so far."""
    return [int(e["worker"]) for e in c.turn_events(count)]


def step_on_new_connection(d: Dialogue, c: Cluster) -> Turn:
    # a new connection per turn: the kernel spreads connections over the workers by address
    with c.client() as client:
        return d.step(client=client)


def test_workers_share_conversations_and_metrics(procs: list[launch.Running], tmp_path: Path, redis_url: str) -> None:
    c = start(procs, tmp_path, redis_url)
    gateway_pid = c.gateway.proc.pid
    first = workers_of(gateway_pid)
    assert len(first) == 2
    with Dialogue(c) as d:
        turns: list[Turn] = []
        while len(turns) < MAX_TURNS and (len(turns) < 4 or set(served_by(c, len(turns))) != first):
            turns.append(step_on_new_connection(d, c))
        assert set(served_by(c, len(turns))) == first  # both workers took turns of the one conversation
        assert all(t.correct for t in turns)
        assert [t.outcome for t in turns[1:]] == ["full"] * (len(turns) - 1)
        # whichever worker answers /metrics reports every worker's turns
        assert metric(c.gateway.url, "turnkv_reuse_decisions_total") == len(turns)
        assert metric(c.gateway.url, "turnkv_store_up") == 1
        assert metric(c.gateway.url, "turnkv_template_class", **{"class": "preserves"}) == 1

        # a worker that dies is replaced; its counts stay in the totals, and the new one serves
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(workers_of(gateway_pid) - {victim}) == 2, what="a replacement worker")
        (replacement,) = workers_of(gateway_pid) - first
        before = len(turns)
        while len(turns) < before + MAX_TURNS and replacement not in served_by(c, len(turns)):
            turns.append(step_on_new_connection(d, c))
    assert replacement in served_by(c, len(turns))
    assert all(t.correct and t.outcome == "full" for t in turns[before:])
    assert metric(c.gateway.url, "turnkv_reuse_decisions_total") == len(turns)
    assert c.gateway.stop() == 0
    assert workers_of(gateway_pid) == set()
    assert not list(tmp_path.glob("turnkv-metrics-*"))  # removed on the way out


def test_a_port_in_use_is_refused(procs: list[launch.Running], tmp_path: Path, redis_url: str) -> None:
    # with SO_REUSEPORT a second gateway could silently join the first's port and take half its traffic
    c = start(procs, tmp_path, redis_url)
    port = str(urlsplit(c.gateway.url).port)
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "turnkv",
            "serve",
            "--prefill",
            c.prefill[0].url,
            "--decode",
            c.decode[0].url,
            "--redis-url",
            redis_url,
            "--workers",
            "2",
            "--port",
            port,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2 and "cannot take" in second.stderr


def test_workers_exit_with_their_supervisor(procs: list[launch.Running], tmp_path: Path, redis_url: str) -> None:
    c = start(procs, tmp_path, redis_url)
    pids = workers_of(c.gateway.proc.pid)
    assert len(pids) == 2
    c.gateway.kill()  # SIGKILL: the supervisor cannot pass anything on
    try:
        wait_for(lambda: not any(alive(p) for p in pids), what="the workers to stop")
    finally:
        for p in filter(alive, pids):
            os.kill(p, signal.SIGKILL)  # leave no orphan serving a port


TIME_WAIT = "06"  # the state column of /proc/net/tcp


def states_on(port: int) -> set[str]:
    """TCP states of the sockets whose local port is ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(fields[3])
    return found


def serve_on(
    port: int, name: str, engines: list[launch.Running], log_dir: Path, redis_url: str, *extra: str
) -> launch.Running:
    """A gateway on a port chosen by the test (launch.spawn always asks for a free one)."""
    log = log_dir / f"{name}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "turnkv",
                "serve",
                "--prefill",
                engines[0].url,
                "--decode",
                engines[1].url,
                "--redis-url",
                redis_url,
                "--port",
                str(port),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    assert proc.stdout is not None
    line = launch._first_line(proc.stdout, proc, launch.READY_TIMEOUT_S)
    running = launch.Running(name, proc, f"http://127.0.0.1:{port}", log)
    if '"listening"' not in line:
        running.stop()
        pytest.fail(f"{name} did not start: {log.read_text()[-2000:]}")
    return running


@pytest.mark.parametrize("before", [(), ("--workers", "2")], ids=["after-one-process", "after-workers"])
def test_workers_start_at_once_where_a_gateway_just_stopped(
    procs: list[launch.Running], tmp_path: Path, redis_url: str, before: tuple[str, ...]
) -> None:
    """A stopped gateway's connections stay on its port in TIME_WAIT for a minute; the supervisor's port
    holder must bind past them (SO_REUSEADDR), as a restart by compose or systemd does at once. Without
    it the first case fails ("cannot take ...: Address already in use"); the second, workers after
    workers, passed without it too on this project's Linux 6.x machine, where those sockets carry
    SO_REUSEPORT, and is kept for the restart the issue reported."""
    common = ("--time-scale", "0", "--vllm-compat", "0.33")
    engines = [launch.sim(role, role, *common, log_dir=tmp_path) for role in ("prefill", "decode")]
    procs += engines
    port = free_port()
    first = serve_on(port, "first", engines, tmp_path, redis_url, *before)
    procs.append(first)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read()
    first.stop()  # the gateway closes the idle keep-alive connection first: its side goes to TIME_WAIT
    conn.close()
    wait_for(lambda: TIME_WAIT in states_on(port), what="a TIME_WAIT socket on the gateway's port")

    second = serve_on(port, "second", engines, tmp_path, redis_url, "--workers", "2")
    procs.append(second)
    assert TIME_WAIT in states_on(port)  # it started while the port still had one
    with openai.OpenAI(base_url=second.url + "/v1", api_key="key-a", max_retries=0, timeout=60) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            extra_headers={"X-Session-ID": "after-restart"},
        )
    assert raw.parse().choices[0].finish_reason == "length"  # answered all 8 tokens
    assert raw.headers["x-turnkv-outcome"] == "none"


def test_a_port_another_supervisor_is_starting_on_is_refused(tmp_path: Path, redis_url: str) -> None:
    """Until its workers listen, a supervisor's port holder does not listen, and the port check alone would
    let a second supervisor in to share the port: the first one's start-up lock refuses it."""
    port = free_port()
    lock = workers._starting_lock(port)  # what a supervisor holds while its workers start
    assert lock is not None
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "turnkv",
                "serve",
                "--prefill",
                "http://127.0.0.1:9",
                "--decode",
                "http://127.0.0.1:9",
                "--redis-url",
                redis_url,
                "--workers",
                "2",
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        lock.close()
    assert second.returncode == 2 and "another turnkv gateway is starting" in second.stderr


def test_the_caps_count_what_every_worker_holds(procs: list[launch.Running], tmp_path: Path, redis_url: str) -> None:
    """max_inflight is the whole gateway's: with two workers, as many requests as it allows are served however
    the kernel spreads their connections (an equal share each refused some whenever the spread was uneven:
    17,942 503s in one run of 1,000 streams), and one more is refused wherever it lands."""
    cap = 24
    env = {"TMPDIR": str(tmp_path), "TURNKV_LIMITS__MAX_INFLIGHT": str(cap), "TURNKV_LIMITS__RESERVE_SHARE": "0"}
    c = start_cluster(
        procs, tmp_path, compat="0.33", redis_url=redis_url, gateway_args=("--workers", "2"), gateway_env=env
    )
    d = c.decode[0].url
    sim_control(d, delay_ms=60_000)  # D holds every request: each stays in flight at the gateway
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def post(i: int) -> int:
        with httpx.Client(base_url=c.gateway.url, timeout=60) as client:  # a connection of its own
            return client.post("/v1/chat/completions", json={**body, "user": f"u{i}"}).status_code

    with ThreadPoolExecutor(cap) as pool:
        statuses = [pool.submit(post, i) for i in range(cap)]
        wait_for(lambda: sim_state(d)["delayed"] == cap, timeout_s=30, what=f"{cap} requests held at D")
        assert post(cap) == 503  # the gateway holds its cap, whichever worker took this one
        sim_control(d, delay_ms=0)
        assert [s.result() for s in statuses] == [200] * cap
    assert len(set(served_by(c, cap))) == 2  # both workers served some
