"""What the device scripts share: engines (real vLLM, or turnkv's simulator here), the gateway, HTTP.

Standard library only, so the scripts run under the device's plain ``python3`` before anything is
installed. Every engine and gateway is started in its own process session (it outlives the call that
started it) and recorded in ``STATE_DIR/procs/<name>.json``; a later call finds
it there, reuses it when its command line is the same, or stops it (the whole process group).

Backends:
* ``vllm``: ``python3 -m vllm.entrypoints.cli.main serve``, vLLM from this interpreter's environment (``pip
  install vllm``) or the offline install (``VLLM_SITE``); the turnkv plugin is on ``PYTHONPATH`` only for
  engines started with ``plugin=True``.
* ``sim``: ``python -m turnkv sim`` on the same ports, to test these scripts without a GPU. A "plugin"
  engine is a simulator with ``--vllm-compat 0.33`` (streams end with the handle).

Only 127.0.0.1 is used. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
# What gpu/setup.sh installs, and where (gpu/README.md): each under TURNKV_GPU_HOME unless named on its own
GPU_HOME = Path(os.environ.get("TURNKV_GPU_HOME") or ("/root" if os.geteuid() == 0 else Path.home() / ".turnkv-gpu"))
STATE_DIR = Path(os.environ.get("TURNKV_GPU_STATE") or GPU_HOME / "gpu-state")  # process records, engine logs
_OFFLINE_SITE = GPU_HOME / "site"  # vLLM installed from the offline bundle (gpu/offline/install.sh)
# vLLM: the offline install where there is one, else this python3's own environment (pip install vllm)
VLLM_SITE = os.environ.get("TURNKV_VLLM_SITE", str(_OFFLINE_SITE) if (_OFFLINE_SITE / ".done").exists() else "")
PLUGIN_SITE = os.environ.get("TURNKV_PLUGIN_SITE") or str(GPU_HOME / "plugin-site")
GATEWAY_SITE = os.environ.get("TURNKV_GATEWAY_SITE") or str(GPU_HOME / "turnkv-site")
KIT = Path(os.environ.get("TURNKV_KIT") or GPU_HOME / "kit")  # the model folders (gpu/make_model.py)
SHARP_MODEL = GPU_HOME / "models" / "sharp"  # the history-sensitive model (gpu/make_sharp_model.py)
MODEL_NAME = "model"  # --served-model-name
# a prefill for remote decode with nothing to pull (turnkv.engine.vllm.handles.P_ONLY; no turnkv import here)
P_ONLY = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
HEALTH_TIMEOUT_S = 240.0  # an 8b-shaped engine with dummy weights starts in about 2 minutes
HTTP_TIMEOUT_S = 180.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- HTTP ---------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: str
    seconds: float
    json: Any = None
    events: list[str] | None = None  # SSE payloads (the text after "data: "), [DONE] included
    first_event_s: float | None = None  # since the request was sent
    first_token_s: float | None = None  # first event with generated text, reasoning, tool call or token ids


def _conn(url: str, timeout: float) -> http.client.HTTPConnection:
    assert url.startswith(f"http://{HOST}:") or url.startswith("http://localhost:"), url
    hostport = url[len("http://") :].rstrip("/")
    return http.client.HTTPConnection(hostport, timeout=timeout)


def _has_token(payload: str) -> bool:
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    for c in obj.get("choices") or [] if isinstance(obj, dict) else []:
        d = c.get("delta") or {}
        if (
            c.get("text")
            or d.get("content")
            or d.get("reasoning")
            or d.get("reasoning_content")
            or d.get("tool_calls")
            or c.get("token_ids")
        ):
            return True
    return False


def request(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = HTTP_TIMEOUT_S,
) -> Reply:
    """One HTTP request; an SSE answer is read event by event, timing the first token."""
    conn = _conn(url, timeout)
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})} if data is not None else dict(headers or {})
    t0 = time.perf_counter()
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        rh = {k.lower(): v for k, v in resp.getheaders()}
        if "text/event-stream" in rh.get("content-type", ""):
            return _read_sse(resp, rh, t0)
        raw = resp.read().decode("utf-8", "replace")
        rep = Reply(resp.status, rh, raw, time.perf_counter() - t0)
        with contextlib.suppress(ValueError):
            rep.json = json.loads(raw)
        return rep
    finally:
        conn.close()


def _read_sse(resp: http.client.HTTPResponse, headers: dict[str, str], t0: float) -> Reply:
    raw: list[str] = []
    events: list[str] = []
    first_event = first_token = None
    data: list[str] = []
    while True:
        line = resp.readline()
        if not line:
            break
        text = line.decode("utf-8", "replace")
        raw.append(text)
        s = text.rstrip("\r\n")
        if s.startswith("data:"):
            data.append(s[5:].lstrip(" "))
        elif s == "" and data:
            payload = "\n".join(data)
            data = []
            now = time.perf_counter() - t0
            events.append(payload)
            first_event = first_event if first_event is not None else now
            if first_token is None and _has_token(payload):
                first_token = now
    return Reply(
        resp.status,
        headers,
        "".join(raw),
        time.perf_counter() - t0,
        events=events,
        first_event_s=first_event,
        first_token_s=first_token,
    )


def post(
    url: str, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float = HTTP_TIMEOUT_S
) -> Reply:
    return request(url, "POST", path, body, headers, timeout)


def get(url: str, path: str, timeout: float = 30.0) -> Reply:
    return request(url, "GET", path, None, None, timeout)


def chunks(rep: Reply) -> list[Any]:
    """The SSE events as JSON (``"[DONE]"`` kept as the string)."""
    out: list[Any] = []
    for e in rep.events or []:
        try:
            out.append(json.loads(e))
        except ValueError:
            out.append(e)
    return out


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        return get(url, "/health", timeout=timeout).status == 200
    except OSError:
        return False


LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_samples(text: str, names: tuple[str, ...] = ()) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a /metrics body as (name, labels, value), only those whose name starts with one
    of ``names`` where given."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line or line.startswith("#") or (names and not line.startswith(names)):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, rest = name_labels.partition("{")
        labels = dict(LABEL.findall(rest))
        with contextlib.suppress(ValueError):
            out.append((name, labels, float(value)))
    return out


def metrics(url: str) -> dict[str, float]:
    """Sums of each sample name in an engine's /metrics (labels ignored)."""
    out: dict[str, float] = {}
    try:
        text = get(url, "/metrics", timeout=10).raw
    except OSError:
        return out
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


NIXL_KEYS = (
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_post_time_seconds_sum",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:prompt_tokens_by_source_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
)


def nixl_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Transfers between two /metrics readings of one engine, and the rate they moved at."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in NIXL_KEYS}
    count = d["vllm:nixl_xfer_time_seconds_count"]
    secs = d["vllm:nixl_xfer_time_seconds_sum"]
    nbytes = d["vllm:nixl_bytes_transferred_sum"]
    return {
        "transfers": count,
        "bytes": nbytes,
        "xfer_s": secs,
        "post_s": d["vllm:nixl_post_time_seconds_sum"],
        "gb_per_s": (nbytes / secs / 1e9) if secs > 0 else None,
        "failed": d["vllm:nixl_num_failed_transfers_total"],
        "expired": d["vllm:nixl_num_kv_expired_reqs_total"],
    }


# -- engines --------------------------------------------------------------------------------------


@dataclass
class EngineSpec:
    """One engine. ``flags`` are extra ``vllm serve`` flags (translated for the simulator)."""

    name: str
    role: str  # prefill | decode | colocated (the simulator's role; vLLM's is the same binary)
    port: int
    side_port: int
    model: str  # a folder
    mem: float = 0.42
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    plugin: bool = False
    kv_extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config members
    bidirectional: bool = True
    dummy: bool = True  # --load-format dummy (gpu/make_model.py's folders have no weights)
    max_model_len: int = 32768
    sim_extra: list[str] = field(default_factory=list)  # more flags for the simulator only

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def kv_config(spec: EngineSpec) -> str:
    extra = {"bidirectional_kv_xfer": spec.bidirectional, **spec.kv_extra}
    return json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra},
        separators=(",", ":"),
    )


def vllm_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        spec.model,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        HOST,
        "--port",
        str(spec.port),
        "--gpu-memory-utilization",
        str(spec.mem),
        "--enforce-eager",
        "--max-model-len",
        str(spec.max_model_len),
        "--kv-transfer-config",
        kv_config(spec),
    ]
    if spec.dummy:
        cmd += ["--load-format", "dummy"]
    cmd += spec.flags
    env = {
        "PYTHONPATH": pythonpath(VLLM_SITE, PLUGIN_SITE if spec.plugin else ""),
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_port),
        **spec.env,
    }
    if not spec.plugin:
        env["VLLM_TURNKV_PLUGIN"] = "0"  # in case it was installed next to vLLM after all
    return cmd, env


SIM_GPU = "GPU-00000000-sim0-0000-0000-000000000000"
SIM_VALUE_FLAGS = ("--max-num-batched-tokens", "--long-prefill-token-threshold")
SIM_FLAGS = {
    "--no-enable-prefix-caching": ["--no-prefix-caching"],
    "--enable-prefix-caching": ["--prefix-caching"],
    "--trust-request-chat-template": [],
    "--enable-prompt-tokens-details": ["--enable-prompt-tokens-details"],
}


def sim_command(spec: EngineSpec, time_scale: float) -> tuple[list[str], dict[str, str]]:
    """The simulator standing in for ``spec`` (compat 0.33 where the real engine has the plugin)."""
    cmd = [
        sys.executable,
        "-m",
        "turnkv",
        "sim",
        "--role",
        spec.role,
        "--host",
        HOST,
        "--port",
        str(spec.port),
        "--model",
        MODEL_NAME,
        "--vllm-compat",
        "0.33" if spec.plugin else "0.26",
        "--side-channel-port",
        str(spec.side_port),
        "--time-scale",
        str(time_scale),
        "--max-model-len",
        str(spec.max_model_len),
        "--no-thinking",
    ]  # vLLM runs without a reasoning parser
    if not spec.bidirectional:
        cmd.append("--no-bidirectional")
    if spec.plugin:  # as the plugin says the GPU: the one H200 every engine there shares, or the one it is given
        visible = spec.env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0]
        cmd += ["--gpu", SIM_GPU if not visible else f"{SIM_GPU[:-1]}{visible}"]
    for k, v in spec.kv_extra.items():
        if k == "decoder_kv_blocks_ttl":
            cmd += ["--decoder-kv-blocks-ttl", str(v)]
        elif k == "kv_recompute_threshold":
            cmd += ["--kv-recompute-threshold", str(v)]
        elif k == "kv_lease_duration":
            cmd += ["--kv-lease-duration", str(v)]
    if spec.env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") == "y":
        cmd += ["--link", "h200-ipc"]  # the link that setting gave on the H200 host
    for i, f in enumerate(spec.flags):
        if f in SIM_VALUE_FLAGS and i + 1 < len(spec.flags):
            cmd += [f, spec.flags[i + 1]]  # the simulator's flag of the same name and meaning
        else:
            cmd += SIM_FLAGS.get(f, [])
    cmd += spec.sim_extra
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return cmd, env


def backend() -> str:
    return os.environ.get("TURNKV_GPU_BACKEND", "vllm")


def _state_file(name: str) -> Path:
    return STATE_DIR / "procs" / f"{name}.json"


def _alive(pid: int) -> bool:
    """Whether the process runs (a child of ours that exited is reaped here, not counted as alive)."""
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/<pid>/stat), to tell it from a later one with its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _ours(rec: dict[str, Any]) -> bool:
    """Whether the recorded pid is still the process started here (vLLM rewrites its process title,
    so the start time is compared, not the command line)."""
    return rec.get("started") is not None and _start_time(int(rec["pid"])) == rec["started"]


def _group_alive(pgid: int) -> bool:
    # a leader that is our own child (a gateway started by this script) stays a zombie, and keeps its
    # group "alive", until it is reaped
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pgid, os.WNOHANG)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(name: str, timeout_s: float = 30.0) -> None:
    """Stop a recorded process (its whole process group, as pd_down.sh does), if it is still ours."""
    f = _state_file(name)
    if not f.exists():
        return
    rec = json.loads(f.read_text())
    pid = int(rec["pid"])
    if not _alive(pid) or not _ours(rec):
        f.unlink(missing_ok=True)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    # the whole group: vLLM's EngineCore child holds the GPU memory a little after the API server exits
    # (a P restarted 3 s after its stop once found only 35 GiB free)
    while _group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while _group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    f.unlink(missing_ok=True)
    log(f"stopped {name}")


def stop_all(prefix: str = "") -> None:
    for f in sorted((STATE_DIR / "procs").glob(f"{prefix}*.json")):
        stop(f.stem)


def recorded() -> list[dict[str, Any]]:
    """The processes started here and not stopped (their records)."""
    return [json.loads(f.read_text()) for f in sorted((STATE_DIR / "procs").glob("*.json"))]


def log_dir() -> Path:
    d = STATE_DIR / "logs"
    d.mkdir(parents=True, exist_ok=True)
    return d


def log_size(name: str) -> int:
    """The size of ``name``'s log (an engine's or a gateway's): where what it logs next starts."""
    f = log_dir() / f"{name}.log"
    return f.stat().st_size if f.exists() else 0


def log_text(name: str, start: int, max_bytes: int = -1) -> str:
    """What ``name``'s log holds from byte ``start`` on (at most ``max_bytes``); "" when it cannot be read."""
    try:
        with open(log_dir() / f"{name}.log", "rb") as fh:
            fh.seek(start)
            return fh.read(max_bytes).decode("utf-8", "replace")
    except OSError:
        return ""


def log_events(name: str, start: int, max_bytes: int = -1) -> Iterator[dict[str, Any]]:
    """The JSON events (one per line, as the gateway logs) in ``name``'s log from byte ``start`` on."""
    for line in log_text(name, start, max_bytes).splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            yield ev


def _spawn(name: str, cmd: list[str], env: dict[str, str], url: str, timeout_s: float) -> dict[str, Any]:
    (STATE_DIR / "procs").mkdir(parents=True, exist_ok=True)
    rec_file = _state_file(name)
    if rec_file.exists():
        rec = json.loads(rec_file.read_text())
        if rec.get("cmd") == cmd and rec.get("env") == env and _ours(rec) and healthy(url):
            log(f"{name}: already running ({url})")
            return dict(rec)
        stop(name)
    logf = log_dir() / f"{name}.log"
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(logf, "ab") as out:
        out.write(f"\n==== {time.strftime('%H:%M:%S')} {shlex.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
            cwd=str(ROOT),
        )
    rec = {
        "name": name,
        "pid": proc.pid,
        "started": _start_time(proc.pid),
        "cmd": cmd,
        "env": env,
        "url": url,
        "log": str(logf),
    }
    rec_file.write_text(json.dumps(rec))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            rec_file.unlink(missing_ok=True)
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail(logf)}")
        if healthy(url):
            rec["start_s"] = round(time.monotonic() - t0, 1)
            rec_file.write_text(json.dumps(rec))
            log(f"{name}: up after {rec['start_s']} s ({url})")
            return rec
        time.sleep(1.0 if backend() == "sim" else 2.0)
    stop(name)
    raise RuntimeError(f"{name} not healthy after {timeout_s:.0f} s:\n{tail(logf)}")


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def start_engine(spec: EngineSpec, *, time_scale: float = 0.05, timeout_s: float = HEALTH_TIMEOUT_S) -> dict[str, Any]:
    """Start (or reuse) one engine and wait until it answers /health. One at a time: two vLLM
    engines profiling GPU memory at once on one GPU can misread each other (seen on the H200)."""
    cmd, env = vllm_command(spec) if backend() == "vllm" else sim_command(spec, time_scale)
    rec = _spawn(spec.name, cmd, env, spec.url, timeout_s)
    rec["spec"] = asdict(spec)
    return rec


# -- the gateway ------------------------------------------------------------------------------------


def gateway_env() -> dict[str, str]:
    if backend() == "vllm":
        return {"PYTHONPATH": pythonpath(str(ROOT / "src"), GATEWAY_SITE, VLLM_SITE)}
    return {"PYTHONPATH": str(ROOT / "src")}


def pythonpath(*parts: str) -> str:
    """A PYTHONPATH of the folders given (an empty one, such as vLLM from the environment, left out)."""
    return os.pathsep.join(p for p in parts if p)


def start_gateway(
    name: str,
    port: int,
    prefill: list[str],
    decode: list[str],
    *,
    policy: str,
    settings: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """``turnkv serve`` on ``port`` with a YAML config (written as JSON, which YAML reads)."""
    cfg = {
        "prefill": prefill,
        "decode": decode,
        "host": HOST,
        "port": port,
        "policy": {"name": policy},
        "log_level": "info",
        **(settings or {}),
    }
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    cfg_file = STATE_DIR / f"{name}.yaml"
    cfg_file.write_text(json.dumps(cfg, indent=1))
    cmd = [sys.executable, "-m", "turnkv", "serve", "--config", str(cfg_file)]
    digest = hashlib.sha256(cfg_file.read_bytes()).hexdigest()[:12]  # a changed config restarts it
    return _spawn(name, cmd, {**gateway_env(), "TURNKV_CFG_DIGEST": digest}, f"http://{HOST}:{port}", timeout_s)


@contextlib.contextmanager
def gateway(
    name: str, port: int, prefill: list[str], decode: list[str], *, policy: str, settings: dict[str, Any] | None = None
) -> Iterator[str]:
    rec = start_gateway(name, port, prefill, decode, policy=policy, settings=settings)
    try:
        yield str(rec["url"])
    finally:
        stop(name)


# -- prompts made of one-token words ----------------------------------------------------------------


def word_vocabulary(url: str, candidates: list[str], want: int) -> list[tuple[str, int]]:
    """Words that are exactly one token with a leading space on this engine's tokenizer, and stay one
    token next to each other (checked with /tokenize), so generated text re-tokenizes to the same ids."""
    out: list[tuple[str, int]] = []
    seen: set[int] = set()
    for i in range(0, len(candidates), 256):
        batch = candidates[i : i + 256]
        text = "".join(" " + w for w in batch)
        rep = post(url, "/tokenize", {"model": MODEL_NAME, "prompt": text, "add_special_tokens": False})
        toks = (rep.json or {}).get("tokens") or []
        if len(toks) != len(batch):
            for w in batch:  # slow path: one by one
                r = post(url, "/tokenize", {"model": MODEL_NAME, "prompt": " " + w, "add_special_tokens": False})
                t = (r.json or {}).get("tokens") or []
                if len(t) == 1 and t[0] not in seen:
                    seen.add(t[0])
                    out.append((w, t[0]))
                if len(out) >= want:
                    return out
            continue
        for w, t in zip(batch, toks, strict=True):
            if t not in seen:
                seen.add(t)
                out.append((w, t))
            if len(out) >= want:
                return out
    return out


def candidate_words() -> list[str]:
    """Lower-case identifiers from Python's standard library sources: gpu/make_model.py's tokenizer was trained
    on them, so most are single tokens; the simulator's tokenizer has its own word list."""
    import keyword
    import re
    import sysconfig

    words: dict[str, None] = {}
    std = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(std.glob("*.py"))[:400]:
        with contextlib.suppress(OSError):
            for w in re.findall(r"\b[a-z]{4,9}\b", f.read_text(errors="replace")):
                if not keyword.iskeyword(w):
                    words.setdefault(w, None)
        if len(words) > 6000:
            break
    return list(words)


def sim_words() -> list[str]:
    sys.path.insert(0, str(ROOT / "src"))
    from turnkv.sim.tokenizer import Tokenizer

    return list(Tokenizer().words)


def words_for(url: str, want: int = 2000) -> list[tuple[str, int]]:
    cands = sim_words() if backend() == "sim" else candidate_words()
    got = word_vocabulary(url, cands, want)
    if len(got) < min(want, 200):
        raise RuntimeError(f"only {len(got)} one-token words found on {url}")
    return got


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False, default=str))


def out_dir() -> Path:
    d = Path(os.environ.get("OUT") or (ROOT / "results" / "gpu"))
    d.mkdir(parents=True, exist_ok=True)
    return d
