"""Health and usage of a running cache server, read through its admin user.

This module owns :class:`ServerStatus`: up or down, memory used and allowed, keys, evictions, hit
rate, connected clients (summed over a Cluster's nodes, with one row per node), and bytes per
warmstart namespace. Bytes per namespace come from ``SCAN`` + ``MEMORY USAGE`` over the keys under
the warmstart prefix: exact when the key space is small, otherwise a uniform sample scaled up to
the node's key count (``namespace_bytes_exact`` says which). It only reads; it changes nothing on
the server.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from warmstart.compile_cache.keyspace import KEY_PREFIX
from warmstart.server.config import URL_FILES
from warmstart.server.credentials import SIGNING_KEY_FILE, VERIFY_KEY_FILE, Credentials
from warmstart.server.state import ServerState

SAMPLE_KEYS = 2000  # keys measured per node for bytes per namespace; beyond this it is an estimate


@dataclasses.dataclass
class NodeStatus:
    """One redis-server process."""

    host: str
    port: int
    pid: int
    up: bool
    error: str = ""
    used_memory: int = 0
    maxmemory: int = 0
    keys: int = 0
    evicted_keys: int = 0
    keyspace_hits: int = 0
    keyspace_misses: int = 0
    connected_clients: int = 0
    uptime_s: int = 0
    cluster_state: str = ""


@dataclasses.dataclass
class ServerStatus:
    """The whole server: totals over its nodes, plus the nodes themselves."""

    dir: str
    up: bool
    """Every node answers (for a Cluster: and reports ``cluster_state:ok``)."""
    mode: str
    """``single`` or ``cluster``."""
    tls: bool
    nodes: list[NodeStatus]
    namespace_bytes: dict[str, int]
    """Bytes of memory per warmstart namespace (values plus Redis overhead)."""
    namespace_bytes_exact: bool
    writer_url_file: str
    reader_url_file: str
    secret_file: str
    signing_key_file: str = ""
    verify_key_file: str = ""

    @property
    def nodes_up(self) -> int:
        return sum(n.up for n in self.nodes)

    def _sum(self, field: str) -> int:
        return sum(getattr(n, field) for n in self.nodes)

    @property
    def used_memory(self) -> int:
        return self._sum("used_memory")

    @property
    def maxmemory(self) -> int:
        return self._sum("maxmemory")

    @property
    def keys(self) -> int:
        return self._sum("keys")

    @property
    def evicted_keys(self) -> int:
        return self._sum("evicted_keys")

    @property
    def keyspace_hits(self) -> int:
        return self._sum("keyspace_hits")

    @property
    def keyspace_misses(self) -> int:
        return self._sum("keyspace_misses")

    @property
    def connected_clients(self) -> int:
        return self._sum("connected_clients")

    @property
    def error(self) -> str | None:
        """Why the server is not up, in one line; ``None`` when it is."""
        if self.up:
            return None
        down = [n for n in self.nodes if not n.up]
        if not down:  # every node answers, but a Cluster does not serve every slot
            states = sorted({n.cluster_state for n in self.nodes if n.cluster_state})
            return f"every node answers but the cluster is not ok (cluster_state: {', '.join(states) or 'unknown'})"
        first = down[0]
        where = f"{first.host}:{first.port}: {first.error or 'down'}"
        return f"{len(down)} of {len(self.nodes)} nodes do not answer ({where})"

    @property
    def hit_rate(self) -> float | None:
        """Key lookups that found their key, over all lookups since start; ``None`` before any."""
        total = self.keyspace_hits + self.keyspace_misses
        return self.keyspace_hits / total if total else None

    def to_dict(self) -> dict[str, Any]:
        """Stable keys for ``warmstart server status --json``."""
        return {
            "dir": self.dir,
            "up": self.up,
            "error": self.error,
            "mode": self.mode,
            "tls": self.tls,
            "nodes_up": self.nodes_up,
            "nodes_total": len(self.nodes),
            "used_memory": self.used_memory,
            "maxmemory": self.maxmemory,
            "keys": self.keys,
            "evicted_keys": self.evicted_keys,
            "keyspace_hits": self.keyspace_hits,
            "keyspace_misses": self.keyspace_misses,
            "hit_rate": self.hit_rate,
            "connected_clients": self.connected_clients,
            "namespace_bytes": self.namespace_bytes,
            "namespace_bytes_exact": self.namespace_bytes_exact,
            "writer_url_file": self.writer_url_file,
            "reader_url_file": self.reader_url_file,
            "secret_file": self.secret_file,
            "signing_key_file": self.signing_key_file,
            "verify_key_file": self.verify_key_file,
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
        }


def collect(directory: Path, *, sample_keys: int = SAMPLE_KEYS) -> ServerStatus | None:
    """Status of the server started from ``directory``; ``None`` if none ever was."""
    state = ServerState.load(directory)
    if state is None:
        return None
    opts = state.options
    try:
        credentials: Credentials | None = Credentials.load(opts.dir)
    except OSError:
        credentials = None
    nodes: list[NodeStatus] = []
    namespaces: dict[str, int] = {}
    exact = True
    pids = state.pids + [0] * (len(opts.ports) - len(state.pids))
    for port, pid in zip(opts.ports, pids, strict=False):
        node = NodeStatus(host=opts.host, port=port, pid=pid, up=False)
        nodes.append(node)
        if credentials is None:
            node.error = "credentials missing"
            continue
        client = state.client(port, credentials=credentials)
        try:
            _read_info(client, node, cluster=bool(opts.cluster))
            node_exact = _sample_namespaces(client, node.keys, namespaces, sample_keys)
            exact = exact and node_exact
        except Exception as exc:  # a down node is a status, not a failure of `status`
            node.up = False
            node.error = _one_line(exc)
        finally:
            client.close()
    up = bool(nodes) and all(n.up for n in nodes) and (not opts.cluster or all(n.cluster_state == "ok" for n in nodes))
    return ServerStatus(
        dir=str(opts.dir),
        up=up,
        mode="cluster" if opts.cluster else "single",
        tls=opts.tls,
        nodes=nodes,
        namespace_bytes=dict(sorted(namespaces.items(), key=lambda kv: -kv[1])),
        namespace_bytes_exact=exact,
        writer_url_file=str(opts.dir / URL_FILES["writer"]),
        reader_url_file=str(opts.dir / URL_FILES["reader"]),
        secret_file=str(credentials.secret_file if credentials else opts.dir / "secret.key"),
        signing_key_file=str(opts.dir / SIGNING_KEY_FILE),
        verify_key_file=str(opts.dir / VERIFY_KEY_FILE),
    )


def _read_info(client, node: NodeStatus, *, cluster: bool) -> None:
    info = client.info()
    node.up = True
    node.used_memory = int(info.get("used_memory", 0))
    node.maxmemory = int(info.get("maxmemory", 0))
    node.evicted_keys = int(info.get("evicted_keys", 0))
    node.keyspace_hits = int(info.get("keyspace_hits", 0))
    node.keyspace_misses = int(info.get("keyspace_misses", 0))
    node.connected_clients = int(info.get("connected_clients", 0))
    node.uptime_s = int(info.get("uptime_in_seconds", 0))
    node.keys = int((info.get("db0") or {}).get("keys", 0))
    if cluster:
        node.cluster_state = client.cluster("info").get("cluster_state", "")


def _sample_namespaces(client, total_keys: int, out: dict[str, int], limit: int) -> bool:
    """Add this node's bytes per namespace to ``out``; return whether every key was measured."""
    if limit <= 0:
        return total_keys == 0
    cursor, seen = 0, 0
    sampled: dict[str, int] = {}
    while True:
        cursor, keys = client.scan(cursor=cursor, match=f"{KEY_PREFIX}*", count=500)
        if keys:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.memory_usage(key)
            for key, size in zip(keys, pipe.execute(), strict=True):
                if size is not None:  # evicted between SCAN and MEMORY USAGE
                    ns = _namespace_of(key)
                    sampled[ns] = sampled.get(ns, 0) + int(size)
            seen += len(keys)
        if cursor == 0 or seen >= limit:
            break
    complete = cursor == 0
    # SCAN visits hash buckets in an order unrelated to key names, so a prefix of it is a fair sample.
    scale = 1.0 if complete or not seen else total_keys / seen
    for ns, size in sampled.items():
        out[ns] = out.get(ns, 0) + int(size * scale)
    return complete


def _namespace_of(key: bytes) -> str:
    # Store layout (warmstart/compile_cache/remote.py): ws:<namespace>:p:<kind>:<key> and
    # ws:<namespace>:b:{<digest>}:<i>. Namespaces never contain ':'.
    text = key.decode(errors="replace")
    return text[len(KEY_PREFIX) :].split(":", 1)[0]


def _one_line(exc: BaseException) -> str:
    import redis

    if isinstance(exc, redis.ConnectionError) and "refused" in str(exc).lower():
        return "not answering (connection refused)"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()
