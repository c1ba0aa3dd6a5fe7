"""What this machine says about its GPUs' paths (``nvidia-smi``: the GPUs by UUID, ``topo -m`` and
``topo -p2p r``) and its RDMA devices, and whether an engine URL names this machine. Every command is
bounded; a machine without ``nvidia-smi`` just says so."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
from pathlib import Path

from turnkv.doctor.facts import HostFacts

COMMAND_S = 5.0
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "")


def run(args: list[str]) -> str | None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def parse_matrix(text: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo`` matrices (``-m``, ``-p2p r``): cell by (row GPU, column GPU)."""
    out: dict[tuple[int, int], str] = {}
    cols: list[int] = []
    for line in text.splitlines():
        cells = line.split()
        if not cells:
            continue
        if not cols and cells[0].startswith("GPU"):
            cols = [int(c[3:]) for c in cells if c.startswith("GPU") and c[3:].isdigit()]
            continue
        if cols and cells[0].startswith("GPU") and cells[0][3:].isdigit():
            row = int(cells[0][3:])
            for j, cell in zip(cols, cells[1 : 1 + len(cols)], strict=False):
                out[(row, j)] = cell
    return out


def parse_uuids(text: str) -> dict[str, int]:
    """``nvidia-smi --query-gpu=index,uuid --format=csv,noheader``: UUID -> index."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        index, _, uuid = line.partition(",")
        if index.strip().isdigit() and uuid.strip():
            out[uuid.strip()] = int(index)
    return out


def rdma_devices(root: Path = Path("/sys/class/infiniband")) -> tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(root)))
    except OSError:
        return ()


def host_facts() -> HostFacts:
    rdma = rdma_devices()
    if shutil.which("nvidia-smi") is None:
        return HostFacts(rdma=rdma, detail="no nvidia-smi on this machine")
    uuids = run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"])
    if uuids is None:
        return HostFacts(rdma=rdma, detail="nvidia-smi failed")
    return HostFacts(
        nvidia_smi=True,
        uuids=parse_uuids(uuids),
        p2p=parse_matrix(run(["nvidia-smi", "topo", "-p2p", "r"]) or ""),
        topology=parse_matrix(run(["nvidia-smi", "topo", "-m"]) or ""),
        rdma=rdma,
    )


def is_local(url: str) -> bool:
    """Whether ``url`` names this machine (a loopback address, its host name, or one of its addresses)."""
    host = url.split("://", 1)[-1].split("/", 1)[0]
    host = host.rsplit(":", 1)[0].strip("[]") if host.count(":") <= 1 or host.startswith("[") else host
    if host in _LOOPBACK:
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        mine = {socket.gethostbyname(socket.gethostname())}
        return socket.gethostbyname(host) in mine
    except OSError:
        return False
