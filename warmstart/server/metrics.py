"""Prometheus metrics of a cache server, served over HTTP at ``/metrics``.

This module owns the text exposition of :class:`~warmstart.server.status.ServerStatus` (metric
names ``warmstart_server_*``, one series per node where it makes sense) and a small standard-library
HTTP exporter. ``start --metrics-port`` runs the exporter as its own daemon process (``python -m
warmstart.server.metrics --dir DIR``) or, in the foreground, as a thread. Each scrape reads
``INFO`` fresh; bytes per namespace, which needs a key scan, is refreshed at most every
:data:`NAMESPACE_REFRESH_S` seconds.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from warmstart.server.status import ServerStatus, collect

NAMESPACE_REFRESH_S = 60.0  # a key scan per scrape would cost the server more than the metric is worth
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, type, help, NodeStatus attribute
_NODE_METRICS = (
    ("warmstart_server_up", "gauge", "1 when the node answers its admin user", "up"),
    ("warmstart_server_used_memory_bytes", "gauge", "Memory used by Redis", "used_memory"),
    ("warmstart_server_maxmemory_bytes", "gauge", "Memory limit before LRU eviction", "maxmemory"),
    ("warmstart_server_keys", "gauge", "Keys stored", "keys"),
    ("warmstart_server_evicted_keys_total", "counter", "Keys evicted by the LRU policy", "evicted_keys"),
    ("warmstart_server_keyspace_hits_total", "counter", "Key lookups that found the key", "keyspace_hits"),
    ("warmstart_server_keyspace_misses_total", "counter", "Key lookups that did not", "keyspace_misses"),
    ("warmstart_server_connected_clients", "gauge", "Client connections", "connected_clients"),
    ("warmstart_server_uptime_seconds", "gauge", "Seconds since the node started", "uptime_s"),
)


def render(status: ServerStatus) -> str:
    """The Prometheus text exposition of ``status``."""
    out: list[str] = []
    for name, kind, help_text, attr in _NODE_METRICS:
        out += [f"# HELP {name} {help_text}.", f"# TYPE {name} {kind}"]
        for node in status.nodes:
            value = getattr(node, attr)
            out.append(f'{name}{{node="{node.host}:{node.port}"}} {int(value)}')
    hit_rate = status.hit_rate
    out += ["# HELP warmstart_server_hit_ratio Hits over lookups since start, all nodes (NaN before any).",
            "# TYPE warmstart_server_hit_ratio gauge",
            f"warmstart_server_hit_ratio {'NaN' if hit_rate is None else repr(round(hit_rate, 6))}",
            "# HELP warmstart_server_cluster_ok 1 when every node answers (and a Cluster serves every slot).",
            "# TYPE warmstart_server_cluster_ok gauge",
            f"warmstart_server_cluster_ok {int(status.up)}",
            "# HELP warmstart_server_namespace_bytes Memory per warmstart namespace (sampled estimate).",
            "# TYPE warmstart_server_namespace_bytes gauge"]
    for ns, size in status.namespace_bytes.items():
        out.append(f'warmstart_server_namespace_bytes{{namespace="{_escape(ns)}"}} {size}')
    return "\n".join(out) + "\n"


class MetricsServer(ThreadingHTTPServer):
    """HTTP server answering ``GET /metrics`` for the server in ``directory``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, directory: Path, host: str, port: int) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._namespaces: tuple[float, dict[str, int]] = (0.0, {})
        super().__init__((host, port), _Handler)

    def scrape(self) -> str:
        with self._lock:  # one scrape at a time: each opens a connection per node
            refresh = time.monotonic() - self._namespaces[0] > NAMESPACE_REFRESH_S
            status = collect(self.directory, sample_keys=500 if refresh else 0)
            if status is None:
                return "# no server was started from this directory\nwarmstart_server_cluster_ok 0\n"
            if refresh:
                self._namespaces = (time.monotonic(), status.namespace_bytes)
            else:
                status.namespace_bytes = self._namespaces[1]
            return render(status)


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served")
            return
        body = self.server.scrape().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # scrapes every 15 s would flood the log
        pass


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


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


if __name__ == "__main__":
    main()
