"""Which Redis deployment a ``redis_url`` names: one server, a Sentinel-managed master, or a Cluster.

Schemes (``s`` after ``redis`` means TLS, to every server of the deployment)::

    redis://[user:pass@]host:port[/db]            rediss://...   one server
    unix://[user:pass@]/path/to/redis.sock[?db=N]                 one server, on a Unix socket
    redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]    rediss+sentinel://...
    redis+cluster://[user:pass@]host:port[,host:port...]                  rediss+cluster://...

The credentials are the data servers' (Sentinel nodes are asked without them). Options go in
turnkv's settings, not in the URL: a query string is refused (except ``db`` on ``unix://``), so that a
pool size or timeout in the URL cannot silently override the ones the store relies on.
Parsing is pure: it runs at start-up, from the settings' checks, and fails there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit


class Topology(enum.Enum):
    SINGLE = "single"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


@dataclass(frozen=True)
class RedisTarget:
    topology: Topology
    tls: bool
    nodes: tuple[tuple[str, int], ...]  # one server, the Sentinel nodes, or the Cluster's start-up nodes
    db: int = 0
    username: str | None = None
    password: str | None = None
    service: str | None = None  # the Sentinel service (master) name
    path: str | None = None  # unix socket

    def describe(self) -> str:
        """The URL without credentials, for logs."""
        where = self.path or ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{self.topology.value}{'+tls' if self.tls else ''} {where}" + (
            f" service={self.service}" if self.service else ""
        )


_SCHEMES = {
    "redis": (Topology.SINGLE, False),
    "rediss": (Topology.SINGLE, True),
    "redis+sentinel": (Topology.SENTINEL, False),
    "rediss+sentinel": (Topology.SENTINEL, True),
    "redis+cluster": (Topology.CLUSTER, False),
    "rediss+cluster": (Topology.CLUSTER, True),
}
DEFAULT_PORTS = {Topology.SINGLE: 6379, Topology.SENTINEL: 26379, Topology.CLUSTER: 6379}


def parse_redis_url(url: str) -> RedisTarget:
    """The deployment ``url`` names; ``ValueError`` with a message fit for the operator otherwise."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or (scheme not in _SCHEMES and scheme != "unix"):
        raise ValueError(
            f"redis_url {_redact(url)!r}: the scheme must be one of redis://, rediss://, unix://, "
            "redis+sentinel://, rediss+sentinel://, redis+cluster://, rediss+cluster://"
        )
    if scheme == "unix":
        return _parse_unix(url)
    topology, tls = _SCHEMES[scheme]
    authority, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in authority:
        authority, _, query = authority.partition("?")
    if query:
        raise ValueError(f"redis_url {_redact(url)!r}: options go in turnkv's redis_* settings, not in the URL")
    username, password, hosts = _split_userinfo(authority)
    nodes = tuple(_host_port(h, DEFAULT_PORTS[topology], url) for h in hosts.split(","))
    parts = [unquote(p) for p in path.split("/") if p]
    service = None
    db = 0
    if topology is Topology.SENTINEL:
        if not parts:
            raise ValueError(
                f"redis_url {_redact(url)!r}: name the Sentinel service: "
                "redis+sentinel://host:port[,host:port]/service[/db]"
            )
        service, parts = parts[0], parts[1:]
    if parts:
        if len(parts) > 1 or not parts[0].isdigit():
            raise ValueError(f"redis_url {_redact(url)!r}: the path must be a database number")
        db = int(parts[0])
    if topology is Topology.CLUSTER and db != 0:
        raise ValueError(f"redis_url {_redact(url)!r}: Redis Cluster has only database 0")
    if topology is Topology.SINGLE and len(nodes) > 1:
        raise ValueError(
            f"redis_url {_redact(url)!r}: one host for redis://; several are for redis+sentinel:// or redis+cluster://"
        )
    return RedisTarget(topology, tls, nodes, db, username, password, service)


def _parse_unix(url: str) -> RedisTarget:
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if set(query) - {"db"}:
        raise ValueError(
            f"redis_url {_redact(url)!r}: only ?db= is accepted on unix://; options go in turnkv's redis_* settings"
        )
    db_text = query.get("db", ["0"])[0]
    if not db_text.isdigit() or not parts.path:
        raise ValueError(f"redis_url {_redact(url)!r}: expected unix:///path/to/redis.sock[?db=N]")
    return RedisTarget(
        Topology.SINGLE,
        False,
        (),
        int(db_text),
        unquote(parts.username) if parts.username else None,
        unquote(parts.password) if parts.password else None,
        path=unquote(parts.path),
    )


def _split_userinfo(authority: str) -> tuple[str | None, str | None, str]:
    userinfo, at, hosts = authority.rpartition("@")
    if not at:
        return None, None, authority
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None), hosts


def _host_port(text: str, default: int, url: str) -> tuple[str, int]:
    if not text:
        raise ValueError(f"redis_url {_redact(url)!r}: a host is missing")
    if text.startswith("["):  # [ipv6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if port and not port.isdigit():
        raise ValueError(f"redis_url {_redact(url)!r}: bad port in {text!r}")
    n = int(port) if port else default
    if not host or not 0 < n < 65536:
        raise ValueError(f"redis_url {_redact(url)!r}: bad host or port in {text!r}")
    return unquote(host), n


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, tail = rest.rpartition("@")
    return f"{scheme}{sep}***@{tail}" if at and userinfo else url
