"""Prometheus metrics of a cache server, served over HTTP at ``/metrics``.

This module owns the metrics of :class:`~warmstart.server.status.ServerStatus` (metric names
``warmstart_server_*``, one series per node where it makes sense) as a prometheus_client collector,
and the exporter that serves them (prometheus_client's HTTP server). ``start --metrics-port`` runs
the exporter as its own daemon process (``python -m warmstart.server.metrics --dir DIR``) or, in the
foreground, in this process. Each scrape reads ``INFO`` fresh; bytes per namespace, which needs a
key scan, is refreshed at most every :data:`NAMESPACE_REFRESH_S` seconds.
"""

from __future__ import annotations

import argparse
import math
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from warmstart.server.status import ServerStatus, collect

NAMESPACE_REFRESH_S = 60.0  # a key scan per scrape would cost the server more than the metric is worth

# name (without a counter's _total), type, help, NodeStatus attribute
_NODE_METRICS = (
    ("warmstart_server_up", "gauge", "1 when the node answers its admin user", "up"),
    ("warmstart_server_used_memory_bytes", "gauge", "Memory used by Redis", "used_memory"),
    ("warmstart_server_maxmemory_bytes", "gauge", "Memory limit before LRU eviction", "maxmemory"),
    ("warmstart_server_keys", "gauge", "Keys stored", "keys"),
    ("warmstart_server_evicted_keys", "counter", "Keys evicted by the LRU policy", "evicted_keys"),
    ("warmstart_server_keyspace_hits", "counter", "Key lookups that found the key", "keyspace_hits"),
    ("warmstart_server_keyspace_misses", "counter", "Key lookups that did not", "keyspace_misses"),
    ("warmstart_server_connected_clients", "gauge", "Client connections", "connected_clients"),
    ("warmstart_server_uptime_seconds", "gauge", "Seconds since the node started", "uptime_s"),
)
_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


def families(status: ServerStatus) -> list[Any]:
    """The metric families of ``status`` (prometheus_client's ``Metric`` objects)."""
    out: list[Any] = []
    for name, kind, help_text, attr in _NODE_METRICS:
        family = _FAMILIES[kind](name, help_text + ".", labels=["node"])
        for node in status.nodes:
            family.add_metric([f"{node.host}:{node.port}"], int(getattr(node, attr)))
        out.append(family)
    hit_rate = status.hit_rate
    out.append(
        GaugeMetricFamily(
            "warmstart_server_hit_ratio",
            "Hits over lookups since start, all nodes (NaN before any).",
            value=math.nan if hit_rate is None else round(hit_rate, 6),
        )
    )
    out.append(
        GaugeMetricFamily(
            "warmstart_server_cluster_ok",
            "1 when every node answers (and a Cluster serves every slot).",
            value=int(status.up),
        )
    )
    namespaces = GaugeMetricFamily(
        "warmstart_server_namespace_bytes", "Memory per warmstart namespace (sampled estimate).", labels=["namespace"]
    )
    for ns, size in status.namespace_bytes.items():
        namespaces.add_metric([ns], size)
    out.append(namespaces)
    return out


class ServerCollector:
    """prometheus_client collector of the server in ``directory``: ``INFO`` fresh at each scrape."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._namespaces: tuple[float, dict[str, int]] = (0.0, {})

    def collect(self) -> Iterator[Any]:
        with self._lock:  # one scrape at a time: each opens a connection per node
            refresh = time.monotonic() - self._namespaces[0] > NAMESPACE_REFRESH_S
            status = collect(self.directory, sample_keys=500 if refresh else 0)
            if status is None:  # no server was started from this directory
                yield GaugeMetricFamily(
                    "warmstart_server_cluster_ok",
                    "1 when every node answers (and a Cluster serves every slot).",
                    value=0,
                )
                return
            if refresh:
                self._namespaces = (time.monotonic(), status.namespace_bytes)
            else:
                status.namespace_bytes = self._namespaces[1]
        yield from families(status)


class MetricsServer:
    """The exporter of the server in ``directory``: prometheus_client's HTTP server on ``host:port``,
    serving (on a daemon thread) from the moment it is built.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, directory: Path, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServerCollector(directory))
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)

    def serve_forever(self) -> None:
        """Block until :meth:`shutdown`."""
        self._thread.join()

    def shutdown(self) -> None:
        """Stop serving and close the port."""
        self._httpd.shutdown()
        self._httpd.server_close()


def wait_listening(host: str, port: int, proc: subprocess.Popen, timeout: float) -> bool:
    """Wait until something accepts connections on ``host:port``; ``False`` if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "*") else ("::1" if host == "::" else host)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((connect_host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def main(argv: list[str] | None = None) -> None:
    """Run the exporter for ``--dir`` until killed (what ``start --metrics-port`` daemonizes)."""
    parser = argparse.ArgumentParser(prog="python -m warmstart.server.metrics")
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", required=True, type=int)
    args = parser.parse_args(argv)
    MetricsServer(args.dir, args.host, args.port).serve_forever()


if __name__ == "__main__":
    main()
