"""Real ``redis-server`` processes for tests: one node or a Redis Cluster, on free ports."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _wait_ping(port: int, timeout: float = 10.0, password: str | None = None) -> None:
    import redis

    deadline = time.monotonic() + timeout
    client = redis.Redis(port=port, password=password, socket_connect_timeout=0.2)
    while True:
        try:
            if client.ping():
                return
        except redis.exceptions.AuthenticationError:
            return
        except redis.exceptions.ResponseError as exc:  # e.g. NOAUTH: the server is up
            if "NOAUTH" in str(exc) or "NOPERM" in str(exc):
                return
            raise
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
        finally:
            client.close()


@dataclass
class RedisNode:
    """One ``redis-server`` process in its own directory."""

    workdir: Path
    port: int = field(default_factory=free_port)
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisNode":
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir), "--logfile", "redis.log",
                *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_ping(self.port)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class RedisCluster:
    """N masters formed into a Redis Cluster with ``redis-cli --cluster create``."""

    workdir: Path
    size: int = 3
    nodes: list[RedisNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> "RedisCluster":
        for i in range(self.size):
            node = RedisNode(self.workdir / f"node{i}", port=free_cluster_port())
            node.extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-node-timeout", "2000"]
            self.nodes.append(node.start())
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        import redis

        deadline = time.monotonic() + 20
        for node in self.nodes:
            client = redis.Redis(port=node.port)
            while client.cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
                time.sleep(0.05)
            client.close()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
