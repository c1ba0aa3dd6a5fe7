"""The gateway's edges against hostile and heavy clients, with real processes: a gateway on simulated engines,
raw sockets that stall, trickle or never finish a body, other tenants, and the openai SDK as the client that
must still be served (and served correctly)."""

from __future__ import annotations

import json
import resource
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.cluster import Cluster, Dialogue, converse, metric, sim_state, start_cluster
from turnkv import launch

pytestmark = pytest.mark.integration
STALLED = 1100  # more than a default open-file limit of 1024
TRICKLING = 20
CLOSE_WAIT_S = 30.0
ENGINE_WORK = "vllm:prefix_cache_queries_total"  # every request an engine admits adds its prompt


def open_file_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc")


def closed_with(sock: socket.socket, deadline: float) -> bytes:
    """What the gateway sent on a connection before closing it (bounded)."""
    got = b""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            piece = sock.recv(4096)
        except ConnectionResetError:
            return got
        except TimeoutError:
            raise AssertionError("the gateway left a stalled connection open") from None
        if not piece:
            return got
        got += piece


def no_tracebacks(c: Cluster) -> None:
    log = (c.log_dir / "gateway.log").read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_stalled_and_trickling_clients_do_not_take_the_gateway_offline(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * STALLED:
        pytest.skip("the open-file hard limit is too low for this many connections")
    env = {"TURNKV_LIMITS__HEADER_TIMEOUT_S": "3", "TURNKV_LIMITS__BODY_TIMEOUT_S": "3"}
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the engines and gateway start with 1024
    try:
        c = start_cluster(procs, tmp_path, gateway_env=env)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert open_file_limits(c.gateway.proc.pid) == (hard, hard) or hard == resource.RLIM_INFINITY
    host, port = c.gateway.url.removeprefix("http://").split(":")
    attacker = ("127.0.0.2", 0)  # one client, its own address

    def connect() -> socket.socket:
        return socket.create_connection((host, int(port)), timeout=10, source_address=attacker)

    stalled = [connect() for _ in range(STALLED)]
    trickling = [connect() for _ in range(TRICKLING)]
    for s in trickling:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nX-Slow: a")
    body_never_ends = connect()
    body_never_ends.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json"
        b'\r\nContent-Length: 100000\r\n\r\n{"model": "sim-model", '
    )
    with ThreadPoolExecutor(4) as pool:  # normal conversations, meanwhile, through the openai SDK
        runs = list(pool.map(lambda i: converse(c, 2, session=f"conv-{i}"), range(4)))
    assert all(t.correct for turns in runs for t in turns)
    assert [t.outcome for turns in runs for t in turns] == ["none", "full"] * 4
    deadline = time.monotonic() + CLOSE_WAIT_S
    for s in stalled:
        assert closed_with(s, deadline) == b""
    for s in trickling:
        assert closed_with(s, deadline).startswith(b"HTTP/1.1 408 ")
    answer = closed_with(body_never_ends, deadline)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
    for s in [*stalled, *trickling, body_never_ends]:
        s.close()
    assert metric(c.gateway.url, "turnkv_rejected_requests_total", reason="header_timeout") >= STALLED + TRICKLING
    no_tracebacks(c)


def keyed_cluster(procs: list[launch.Running], tmp_path: Path, redis_url: str | None = None) -> Cluster:
    keys = tmp_path / "keys"
    keys.write_text("# test tenants\nsk-alice alice\nsk-bob bob\n")
    env = {
        "TURNKV_API_KEYS_FILE": str(keys),
        "TURNKV_TENANT_HEADER": "x-tenant",
        "TURNKV_TRUSTED_PROXY_SECRET": "proxy-secret",
    }
    return start_cluster(
        procs, tmp_path, gateway_env=env, redis_url=redis_url, sim_flags=("--enable-prompt-tokens-details",)
    )  # P says how much of a prompt it had cached


def test_a_tenant_header_without_the_proxy_secret_reuses_nothing(
    procs: list[launch.Running], tmp_path: Path, redis_url: str
) -> None:
    c = keyed_cluster(procs, tmp_path, redis_url)
    url = c.gateway.url + "/v1"
    with (
        Dialogue(c, api_key="sk-alice", session="shared") as d,
        openai.OpenAI(
            base_url=url, api_key="sk-bob", max_retries=0, timeout=60, default_headers={"x-tenant": "alice"}
        ) as bob,
        openai.OpenAI(
            base_url=url,
            api_key="unused",
            max_retries=0,
            timeout=60,
            default_headers={"x-tenant": "alice", "x-turnkv-proxy-secret": "proxy-secret"},
        ) as proxy,
        openai.OpenAI(base_url=url, api_key="sk-nobody", max_retries=0, timeout=60) as nobody,
    ):
        first = d.step()
        assert first.correct and first.reason == "no_record"
        # Bob: Alice's session id, Alice's tenant header, Alice's very history; no proxy secret
        stranger = d.step(client=bob)
        assert stranger.correct and stranger.reason == "no_record"
        assert stranger.headers["x-turnkv-matched-tokens"] == "0"
        # nor does P's prefix cache answer him from Alice's prompt (each tenant its own cache_salt)
        assert stranger.headers["x-turnkv-prefill-cached-tokens"] == "0"
        d.messages = d.messages[:-2]
        # the trusted proxy naming Alice gets Alice's record, which Bob neither read nor consumed
        again = d.step(client=proxy)
        assert again.correct and again.outcome == "full"
        with pytest.raises(openai.AuthenticationError):
            nobody.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}])
    no_tracebacks(c)


def test_the_rest_of_the_endpoint(procs: list[launch.Running], tmp_path: Path) -> None:
    c = keyed_cluster(procs, tmp_path)
    engine = c.prefill[0].url
    alice = {"authorization": "Bearer sk-alice"}
    with httpx.Client(base_url=c.gateway.url, timeout=30) as gw, httpx.Client(base_url=engine, timeout=30) as p:
        for path, body in [
            ("/tokenize", {"model": "sim-model", "prompt": "hello there"}),
            ("/detokenize", {"model": "sim-model", "tokens": [1, 2, 3]}),
        ]:
            assert gw.post(path, json=body).status_code == 401
            r = gw.post(path, json=body, headers=alice)
            assert r.status_code == 200 and r.json() == p.post(path, json=body).json()
        bad = gw.post("/detokenize", json={"tokens": "no"}, headers=alice)
        assert bad.status_code == 400 and set(bad.json()["error"]) >= {"message", "type"}  # the engine's words
        assert gw.get("/version", headers=alice).json() == p.get("/version").json()
        one = gw.get("/v1/models/sim-model", headers=alice).json()
        assert one["id"] == "sim-model" and one["max_model_len"] > 0
        missing = gw.get("/v1/models/other", headers=alice)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert gw.get("/v1/models/sim-model").status_code == 401
        assert gw.get("/ready").json() == {"ready": True}  # a load balancer's view, no engine URLs
        assert gw.get("/metrics", headers=alice).status_code == 403
    no_tracebacks(c)


def bad_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Requests for the conversation's next turn that must be refused before any engine work."""
    base = {"model": "sim-model", "messages": messages, "max_tokens": 60, "session_id": "conv-1"}
    broken_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}
    return [
        {**base, "max_tokens": "40"},
        {**base, "max_tokens": 10**6},  # above the model's context length
        {**base, "max_completion_tokens": 40960},  # exactly the context length: no room for a prompt
        {**base, "messages": [*messages[:-1], broken_call, messages[-1]]},
        {**base, "session_id": "conv-1\n"},  # not conv-1: refused, not another conversation
    ]


def test_bad_input_is_refused_before_any_engine_work_and_keeps_the_record(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    c = start_cluster(procs, tmp_path)
    with Dialogue(c) as d, httpx.Client(base_url=c.gateway.url, timeout=30) as http:
        assert d.step().reason == "no_record"

        def engine_work() -> tuple[Any, ...]:
            engines = [*c.prefill, *c.decode]
            return (*(metric(e.url, ENGINE_WORK) for e in engines), *(sim_state(e.url)["renders"] for e in engines))

        before = engine_work()
        headers = {"Authorization": "Bearer key-a"}
        for body in bad_turns(d.messages):
            r = http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        surrogate = json.dumps({"model": "sim-model", "messages": d.messages, "session_id": "conv-1"})
        surrogate = surrogate.replace("Thanks", "\\ud800Thanks")
        r = http.post(
            "/v1/chat/completions", content=surrogate.encode(), headers={**headers, "content-type": "application/json"}
        )
        assert r.status_code == 400
        assert engine_work() == before
        after = d.step()
        assert after.correct and after.outcome == "full"  # the record survived every refused request
    no_tracebacks(c)


def test_a_place_in_flight_is_free_once_the_client_has_its_last_byte(
    procs: list[launch.Running], tmp_path: Path, redis_url: str
) -> None:
    # as many clients as places, each sending its next turn (or a new conversation's first) the moment the
    # last one's stream ended: none is refused, so no turn's place outlives its stream's last byte (the
    # turn's clean-up, Redis included, runs before that byte: the next turn must find its record)
    clients = 4
    c = start_cluster(
        procs,
        tmp_path,
        compat="0.33",  # D's handle in the stream
        redis_url=redis_url,
        gateway_env={"TURNKV_LIMITS__MAX_INFLIGHT": str(clients)},
    )

    def run(i: int) -> list[str]:
        outcomes = []
        for k in range(3):
            with Dialogue(c, session=f"c{i}-{k}", stream=True, max_tokens=8) as d:
                outcomes += [d.step(truth=False).outcome for _ in range(3)]
        return outcomes

    with ThreadPoolExecutor(clients) as pool:
        outcomes = [o for got in pool.map(run, range(clients)) for o in got]
    assert len(outcomes) == clients * 9 and outcomes.count("full") == clients * 3 * 2
    assert metric(c.gateway.url, "turnkv_rejected_requests_total", reason="server_overloaded") == 0
    no_tracebacks(c)


def _one_response(sock: socket.socket) -> bytes:
    """Read one whole HTTP/1.1 response with a Content-Length (bounded by the socket's timeout)."""
    got = b""
    while b"\r\n\r\n" not in got:
        piece = sock.recv(4096)
        assert piece, "the gateway closed the connection before answering"
        got += piece
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        piece = sock.recv(4096)
        assert piece, "the gateway closed the connection mid-answer"
        body += piece
    return head


def test_an_idle_kept_alive_connection_outlives_the_clients_own_pools(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # Clients keep idle connections in their pools for 5-15 s (httpx and the openai SDK 5, aiohttp 15) and
    # reuse them; a server that closes sooner, or at the same moment, gets a request on a closing connection
    # now and then (a reset at the client). The gateway keeps an idle one longer than uvicorn's own 5 s.
    c = start_cluster(procs, tmp_path)
    host, port = c.gateway.url.removeprefix("http://").split(":")
    request = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        assert _one_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.settimeout(7.0)  # idle for longer than uvicorn's default keep-alive: nothing may arrive, not even EOF
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.settimeout(10)
        sock.sendall(request)  # the same connection, reused
        assert _one_response(sock).startswith(b"HTTP/1.1 200 ")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc")


def attacker(c: Cluster, source: str = "127.0.0.2") -> Any:
    host, port = c.gateway.url.removeprefix("http://").split(":")

    def connect() -> socket.socket:
        return socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))

    return connect


def high_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * STALLED:
        pytest.skip("the open-file hard limit is too low for this many connections")


def test_stalled_uploads_hold_no_place_a_whole_turn_needs(procs: list[launch.Running], tmp_path: Path) -> None:
    """1,100 uploads from one address that send one byte of a 2,000-byte body and stop: they hold the small
    budget of requests still arriving (an address holding many gets none of its reserve), never a place in
    flight, so another address's turns are served while they wait out their body deadline."""
    high_fd_limit()
    c = start_cluster(procs, tmp_path, gateway_env={"TURNKV_LIMITS__BODY_TIMEOUT_S": "5"})
    connect = attacker(c)
    stalled = [connect() for _ in range(STALLED)]
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    for s in stalled:
        s.sendall(head + b"Content-Length: 2000\r\n\r\n{")
    runs = [converse(c, 2, session=f"conv-{i}") for i in range(3)]  # meanwhile, from 127.0.0.1
    assert all(t.correct for turns in runs for t in turns)
    assert [t.outcome for turns in runs for t in turns] == ["none", "full"] * 3
    deadline = time.monotonic() + CLOSE_WAIT_S
    answers = [closed_with(s, deadline) for s in stalled]
    statuses = {a.split(b" ", 2)[1] for a in answers if a}
    assert statuses <= {b"408", b"429"}, statuses  # their body deadline, or no place to wait in at all
    assert b"408" in statuses and b"429" in statuses
    for s in stalled:
        s.close()
    assert metric(c.gateway.url, "turnkv_rejected_requests_total", reason="server_overloaded") == 0
    no_tracebacks(c)


def test_large_headers_are_cut_short_and_memory_stays_flat(procs: list[launch.Running], tmp_path: Path) -> None:
    """400 connections each sending 4 MB of headers that never end: each is answered 431 once its head passes
    max_header_bytes (64 KiB) and closed, so the gateway buffers at most that much of each (uvicorn buffered
    them whole: 75 -> 1,700 MiB); turns from another address are served meanwhile."""
    c = start_cluster(procs, tmp_path)
    converse(c, 1, session="warm")  # a started, warm gateway: its memory before the attack
    before = rss_mib(c.gateway.proc.pid)
    connect = attacker(c)
    chunk = b"a" * 65536
    taken = 0
    conns = []
    for _ in range(400):
        s = connect()
        conns.append(s)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nX-Big: ")
        for _ in range(64):  # up to 4 MiB, unless the gateway closes first
            try:
                s.sendall(chunk)
            except OSError:  # reset: the gateway closed on it
                break
            taken += len(chunk)
    runs = [converse(c, 2, session=f"conv-{i}") for i in range(2)]
    assert all(t.correct for turns in runs for t in turns)
    deadline = time.monotonic() + CLOSE_WAIT_S
    answers = [closed_with(s, deadline) for s in conns]
    assert all(a == b"" or a.startswith(b"HTTP/1.1 431 ") for a in answers)  # a reset may beat the answer
    for s in conns:
        s.close()
    grown = rss_mib(c.gateway.proc.pid) - before
    # the kernel's socket buffers take some of each send before the gateway reads it, so more than 64 KiB a
    # connection was sent; what the gateway holds is bounded all the same (by far less than the 1.6 GB sent
    # were they all taken)
    assert taken < 400 * (4 << 20) and grown < 64, (taken, grown)
    assert metric(c.gateway.url, "turnkv_rejected_requests_total", reason="header_too_large") >= 1
    no_tracebacks(c)


def test_one_address_holding_every_connection_it_can_does_not_stop_another(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    """8,400 idle sockets from one address against the default cap of 8,192, scaled down tenfold: 840 against
    a cap of 819 (the behaviour is the same at any size: the cap and its reserve are shares). The address gets
    no more than the cap less the reserve kept for those holding little; another address's turns and health
    checks are served, and the first address's own health check too (answered over the cap)."""
    high_fd_limit()
    env = {"TURNKV_LIMITS__MAX_CLIENT_CONNECTIONS": "819", "TURNKV_LIMITS__HEADER_TIMEOUT_S": "120"}
    c = start_cluster(procs, tmp_path, gateway_env=env)
    connect = attacker(c)
    idle = [connect() for _ in range(840)]
    held = 819 - 819 // 8  # the cap less its reserve
    deadline = time.monotonic() + CLOSE_WAIT_S
    while len(select.select(idle, [], [], 0.1)[0]) < 840 - held:  # those refused are answered and closed
        assert time.monotonic() < deadline, "the connections over the cap were not closed"
    probe = connect()  # the attacker's own address, holding what it may
    probe.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
    answer = closed_with(probe, time.monotonic() + CLOSE_WAIT_S)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}'), answer
    with httpx.Client(base_url=c.gateway.url, timeout=30) as other:  # 127.0.0.1
        assert other.get("/health").status_code == 200 and other.get("/ready").json()["ready"] is True
    runs = [converse(c, 2, session=f"conv-{i}") for i in range(3)]
    assert all(t.correct for turns in runs for t in turns)
    refused = metric(c.gateway.url, "turnkv_rejected_requests_total", reason="connection_cap_per_ip")
    assert refused >= 840 - held
    for s in [*idle, probe]:
        s.close()
    no_tracebacks(c)
