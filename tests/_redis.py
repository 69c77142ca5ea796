"""Ports and real ``redis-server`` processes for tests: the one place tests get a free port, a closed
port, a single node or a Redis Cluster from.

Tests that need ``redis-server`` get it through :func:`require_redis_server` (``RedisNode.start``,
``RedisCluster.start`` and the server fixtures call it): where the binary is missing the test is
skipped with the reason, so the pure tests still run; under CI (``$CI`` set) a missing binary fails
the test instead, since ``make test`` installs it there.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from warmstart._net import free_port  # tests import it from here, with the other port helpers

CLUSTER_BUS_OFFSET = 10000  # a Cluster node also listens on port + 10000


# -- the redis-server binary -------------------------------------------------------------------


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_redis_binary(name: str = "redis-server") -> str:
    """Path of ``name`` (``redis-server`` or ``redis-cli``) on ``$PATH``. Where there is none the
    calling test is skipped with the reason, or fails under CI, where a missing one is a broken setup."""
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} not found on PATH: install it (apt-get install redis-server) or run `make test`"
    if in_ci():
        pytest.fail(
            f"{reason}; CI is set, where `make test` installs it, so this is an error, not a skip", pytrace=False
        )
    pytest.skip(reason)


def require_redis_server() -> str:
    """Path of ``redis-server``; skips the calling test where it is missing (fails it under CI)."""
    return require_redis_binary("redis-server")


# -- ports -------------------------------------------------------------------------------------


def port_is_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` (a port in TIME_WAIT counts as free, as for redis-server)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _base_ports() -> range:
    # Bases come from 20000-29999, so that their Cluster bus ports (+10000) stay below 40000, and each
    # pytest-xdist worker draws from its own slice: two workers never pick the same free port between
    # the check and redis-server's bind.
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % count if worker.isdigit() else 0
    span = 10000 // count
    return range(20000 + index * span, 20000 + (index + 1) * span - 16)


def free_port_block(n: int, *, bus: bool = False) -> int:
    """A base port such that base..base+n-1 (and, with ``bus``, their Cluster bus ports) are free."""
    bases = _base_ports()
    for _ in range(200):
        base = random.choice(bases)
        ports = [base + i for i in range(n)]
        if bus:
            ports += [port + CLUSTER_BUS_OFFSET for port in ports]
        if all(port_is_free(p) for p in ports):
            return base
    raise RuntimeError(f"no free block of {n} ports")


def closed_port_url() -> str:
    """A redis:// URL on a local port nothing listens on (connection refused at once)."""
    return f"redis://127.0.0.1:{free_port()}/0"


# -- nodes and clusters ------------------------------------------------------------------------


def _wait_ping(node: RedisNode, timeout: float = 10.0, password: str | None = None) -> None:
    import redis

    deadline = time.monotonic() + timeout  # hang guard for start-up, not a speed check
    client = redis.Redis(port=node.port, password=password, socket_connect_timeout=0.2)
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
            if node.proc is not None and node.proc.poll() is not None:
                log = node.workdir / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(
                    f"redis-server on port {node.port} exited with {node.proc.returncode}:\n{tail}"
                ) from None
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

    def start(self) -> RedisNode:
        binary = require_redis_server()
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            "redis.log",
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ping(self)
        except BaseException:
            self.stop()
            raise
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
    """N masters on a block of free ports, formed into a Redis Cluster with ``redis-cli --cluster create``."""

    workdir: Path
    size: int = 3
    nodes: list[RedisNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisCluster:
        require_redis_server()
        cli = require_redis_binary("redis-cli")
        try:
            self._form(cli)
        except BaseException:
            self.stop()  # no node outlives a cluster that failed to form
            raise
        return self

    def _form(self, cli: str) -> None:
        import redis

        base = free_port_block(self.size, bus=True)
        for i in range(self.size):
            node = RedisNode(self.workdir / f"node{i}", port=base + i)
            node.extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ]
            self.nodes.append(node)
            node.start()
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in self.nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 20  # hang guard for forming the cluster, not a speed check
        for node in self.nodes:
            client = redis.Redis(port=node.port)
            try:
                while client.cluster("info").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
                    time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
