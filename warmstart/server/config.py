"""What a cache server is asked to be, and the ``redis.conf`` each of its nodes runs with.

This module owns :class:`ServerOptions` (one frozen dataclass, checked on construction), the
server defaults with their units, and the text of the generated Redis configuration: bind address,
protected mode, ``maxmemory`` with ``allkeys-lru``, no persistence unless AOF is asked for, the ACL
file, TLS and Cluster settings. It is pure: it reads and starts nothing (see ``preflight`` and
``process`` for that).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Mapping
from pathlib import Path

from warmstart.config import server_settings
from warmstart.errors import ConfigError

DEFAULT_PORT = 6379
DEFAULT_BIND = "127.0.0.1"
DEFAULT_MAXMEMORY = 1024**3  # 1 GiB across all nodes
# 16 MiB per node. Redis counts client buffers toward maxmemory, and values arrive in chunks of up
# to 8 MiB. Below this, a few concurrent writes leave nothing to evict, and Redis answers OOM
# instead of evicting.
MIN_MAXMEMORY = 16 * 1024**2
MIN_CLUSTER_NODES = 3  # what `redis-cli --cluster create` accepts without replicas
CLUSTER_BUS_OFFSET = 10000  # Redis Cluster's bus listens on port + 10000
CLUSTER_NODE_TIMEOUT_MS = 5000
ACL_FILE = "users.acl"
STATE_FILE = "state.json"
URL_FILES = {"writer": "writer.url", "reader": "reader.url"}  # the URLs to hand out, one per user


class OptionError(ConfigError):
    """A :class:`ConfigError` whose one-line message is written out in full, for problems that
    the ``variable=value is not valid`` form would say badly."""

    def __init__(self, variable: str, value: object, accepted: str, message: str) -> None:
        super().__init__(variable, value, accepted)
        self.args = (message,)

    def __str__(self) -> str:
        return self.args[0]


def default_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$WARMSTART_SERVER_DIR``, else ``$XDG_STATE_HOME/warmstart/server``, else
    ``~/.local/state/warmstart/server``."""
    return server_settings(environ).dir


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """One ``warmstart server start`` request, checked on construction."""

    dir: Path
    """Where configuration, secrets, logs, pid files and data live."""
    port: int = DEFAULT_PORT
    """Client port of the (first) node; Cluster nodes take ``port``, ``port+1``, ..."""
    bind: str = DEFAULT_BIND
    """Address Redis listens on."""
    maxmemory: int = DEFAULT_MAXMEMORY
    """Bytes of cache in total; a Cluster splits it evenly across its nodes."""
    cluster: int = 0
    """Number of Cluster masters; 0 runs one plain node."""
    aof: bool = False
    """Turn on the append-only file, so the cache survives a restart."""
    tls_cert: Path | None = None
    """Server certificate (PEM); with ``tls_key`` it switches clients to TLS only."""
    tls_key: Path | None = None
    """Private key of ``tls_cert`` (PEM)."""
    tls_ca: Path | None = None
    """CA bundle clients verify the server against; defaults to ``tls_cert`` (self-signed)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (same bind address); ``None``: no exporter."""
    advertise: str | None = None
    """Host name or address put in the URLs; defaults to the bind address (or this host's address)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", Path(self.dir).expanduser().absolute())
        for port, flag in ((self.port, "--port"), (self.metrics_port, "--metrics-port")):
            if port is not None and not 0 < port < 65536:
                raise ConfigError(flag, port, "a TCP port between 1 and 65535")
        if self.cluster and self.cluster < MIN_CLUSTER_NODES:
            raise ConfigError("--cluster", self.cluster, f"0 (one node) or at least {MIN_CLUSTER_NODES} masters")
        if self.cluster < 0:
            raise ConfigError("--cluster", self.cluster, f"0 (one node) or at least {MIN_CLUSTER_NODES} masters")
        if self.cluster and self.port + self.cluster - 1 + CLUSTER_BUS_OFFSET > 65535:
            raise ConfigError(
                "--port",
                self.port,
                f"a port at most {65535 - CLUSTER_BUS_OFFSET - self.cluster + 1} "
                f"(a Cluster also uses port+{CLUSTER_BUS_OFFSET} for its bus)",
            )
        if self.maxmemory < MIN_MAXMEMORY * max(1, self.cluster):
            raise ConfigError(
                "--maxmemory", self.maxmemory, "at least 16MiB per node (values travel in chunks of up to 8 MiB)"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("--tls-cert", "--tls-key") if self.tls_key is None else ("--tls-key", "--tls-cert")
            raise OptionError(
                missing,
                None,
                "both --tls-cert and --tls-key, or neither",
                f"{given} needs {missing} too: TLS takes both a certificate and its key",
            )
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-ca", str(self.tls_ca), "--tls-ca together with --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value).expanduser().absolute())
        if self.metrics_port is not None and self.metrics_port in self.ports:
            raise ConfigError("--metrics-port", self.metrics_port, "a port the Redis nodes do not use")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def ca_file(self) -> Path | None:
        """The CA clients verify the server with (the certificate itself when no CA is given)."""
        return self.tls_ca or self.tls_cert

    @property
    def ports(self) -> list[int]:
        """Client port of each node."""
        return [self.port + i for i in range(max(1, self.cluster))]

    @property
    def maxmemory_per_node(self) -> int:
        return self.maxmemory // max(1, self.cluster)

    @property
    def host(self) -> str:
        """The host clients are told to connect to."""
        if self.advertise:
            return self.advertise
        if not _is_wildcard(self.bind):
            return self.bind.split()[0]
        return _primary_address()

    def to_dict(self) -> dict[str, object]:
        """JSON-safe form, kept in the state file so a restart can reuse it."""
        return {
            f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ServerOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # type: ignore[arg-type]


def node_dir(options: ServerOptions, index: int) -> Path:
    """Directory of node ``index`` (data, log, pid file, Cluster state). Indexed, not by port,
    so that AOF data survives a restart on other ports."""
    return options.dir / f"node{index}"


def render_redis_conf(options: ServerOptions, index: int, *, daemonize: bool) -> str:
    """The ``redis.conf`` text of node ``index``."""
    ndir = node_dir(options, index)
    port = options.ports[index]
    lines = [
        "# Generated by `warmstart server start`; regenerated on every start. The ACL file is",
        "# generated too, from warmstart/server/acl.py (writer, reader and admin users; default off).",
        f"bind {options.bind}",
        "protected-mode yes",
        f"daemonize {'yes' if daemonize else 'no'}",
        f"pidfile {_q(ndir / 'redis.pid')}",
        f"logfile {_q(ndir / 'redis.log')}",
        f"dir {_q(ndir)}",
        f"aclfile {_q(options.dir / ACL_FILE)}",
        # One database: namespaces separate teams, and a Cluster only has db 0 anyway.
        "databases 1",
        f"maxmemory {options.maxmemory_per_node}",
        "maxmemory-policy allkeys-lru",
        "maxmemory-samples 10",  # closer to true LRU than the default 5, for little CPU
        # Evicting or overwriting multi-megabyte values frees them off the main thread.
        "lazyfree-lazy-eviction yes",
        "lazyfree-lazy-expire yes",
        "lazyfree-lazy-server-del yes",
        "lazyfree-lazy-user-del yes",
        'save ""',
        f"appendonly {'yes' if options.aof else 'no'}",
        "appendfsync everysec",
        "tcp-keepalive 60",
    ]
    if options.tls:
        lines += [
            "port 0",
            f"tls-port {port}",
            f"tls-cert-file {_q(options.tls_cert)}",
            f"tls-key-file {_q(options.tls_key)}",
            f"tls-ca-cert-file {_q(options.ca_file)}",
            # Passwords authenticate clients; a client certificate is checked only if one is shown.
            "tls-auth-clients optional",
        ]
    else:
        lines.append(f"port {port}")
    if options.cluster:
        lines += [
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {CLUSTER_NODE_TIMEOUT_MS}",
            # A cache keeps serving the slots it still has when one node is down.
            "cluster-require-full-coverage no",
            "cluster-allow-reads-when-down yes",
        ]
        if options.tls:
            lines += ["tls-cluster yes", "tls-replication yes"]
        host = options.host
        if _is_ip(host) and _is_wildcard(options.bind):
            lines.append(f"cluster-announce-ip {host}")
    return "\n".join(lines) + "\n"


def _q(path: Path | None) -> str:
    text = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def is_loopback(bind: str) -> bool:
    """Whether every address of a ``bind`` line is a loopback one (127.0.0.0/8, ::1, localhost)."""
    for addr in bind.split():
        addr = addr.lstrip("-")
        if addr == "localhost":
            continue
        try:
            if not ipaddress.ip_address(addr).is_loopback:
                return False
        except ValueError:
            return False
    return bool(bind.split())


def _is_wildcard(bind: str) -> bool:
    return any(addr.lstrip("-") in ("0.0.0.0", "::", "*") for addr in bind.split())


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _primary_address() -> str:
    # The address of the interface the default route uses; connecting a UDP socket sends nothing.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.254.254.254", 1))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostname()
