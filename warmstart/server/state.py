"""The record of a server directory (``state.json``) and how to reach the server it describes.

This module owns what ``start`` leaves behind for ``status``, ``stop`` and the metrics exporter:
the options the server runs with, its nodes' ports and pids, the exporter's pid, and the URLs and
redis-py clients for each ACL user built from them. Liveness of a pid is judged here too (a
zombie counts as gone). It starts and stops nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from warmstart.server.config import STATE_FILE, ServerOptions
from warmstart.server.credentials import Credentials, write_private

_CLIENT_TIMEOUT_S = 2.0  # admin commands (PING, INFO, SHUTDOWN) answer fast on a healthy node


@dataclasses.dataclass
class ServerState:
    """What one ``warmstart server start`` left in its directory."""

    options: ServerOptions
    pids: list[int] = dataclasses.field(default_factory=list)
    """Pid of each node's redis-server, in node order (0 when unknown)."""
    exporter_pid: int = 0
    """Pid of the daemonized metrics exporter, 0 when none."""
    supervisor_pid: int = 0
    """Pid of the ``start --foreground`` process that owns the nodes, 0 when daemonized."""
    started_at: float = 0.0
    """Unix time the server answered."""

    @property
    def path(self) -> Path:
        return self.options.dir / STATE_FILE

    @classmethod
    def load(cls, directory: Path) -> ServerState | None:
        """The state in ``directory``, or ``None`` when no server was ever started from it."""
        try:
            data = json.loads((Path(directory) / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        return cls(
            options=ServerOptions.from_dict(data["options"]),
            pids=list(data.get("pids", [])),
            exporter_pid=int(data.get("exporter_pid", 0)),
            supervisor_pid=int(data.get("supervisor_pid", 0)),
            started_at=float(data.get("started_at", 0.0)),
        )

    def save(self) -> None:
        data = {
            "options": self.options.to_dict(),
            "pids": self.pids,
            "exporter_pid": self.exporter_pid,
            "supervisor_pid": self.supervisor_pid,
            "started_at": self.started_at,
        }
        write_private(self.path, json.dumps(data, indent=2) + "\n")

    # -- reaching the server -------------------------------------------------------------------

    def url(self, user: str, credentials: Credentials) -> str:
        """The URL ``user`` connects with: ``redis://`` / ``rediss://`` for one node,
        ``redis+cluster://`` / ``rediss+cluster://`` listing every node for a Cluster. TLS URLs
        name the CA file in ``ssl_ca_certs`` so redis-py verifies the server."""
        opts = self.options
        scheme = ("rediss" if opts.tls else "redis") + ("+cluster" if opts.cluster else "")
        hosts = ",".join(f"{_url_host(opts.host)}:{port}" for port in opts.ports)
        url = f"{scheme}://{user}:{credentials.passwords[user]}@{hosts}" + ("" if opts.cluster else "/0")
        if opts.tls:
            url += f"?ssl_ca_certs={quote(str(opts.ca_file), safe='/')}"
        return url

    def client(self, port: int, user: str = "admin", credentials: Credentials | None = None):
        """A redis-py client of the node on ``port``, authenticated as ``user``."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        creds = credentials or Credentials.load(self.options.dir)
        # No retries: redis-py's default retries with backoff for seconds, and a node that does
        # not answer (or one we just shut down) should be reported at once.
        kwargs: dict[str, Any] = dict(
            host=self.options.host,
            port=port,
            username=user,
            password=creds.passwords[user],
            socket_timeout=_CLIENT_TIMEOUT_S,
            socket_connect_timeout=_CLIENT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        if self.options.tls:
            # Our own node, found through our own state file: verify the chain, not the name
            # (the certificate may name the public host while we dial the bind address).
            kwargs.update(ssl=True, ssl_ca_certs=str(self.options.ca_file), ssl_check_hostname=False)
        return redis.Redis(**kwargs)

    def running_pids(self) -> list[int]:
        """Pids of this server's processes (supervisor, nodes, exporter) that are still alive."""
        owned = [
            (self.supervisor_pid, "warmstart"),
            *[(p, "redis") for p in self.pids],
            (self.exporter_pid, "warmstart"),
        ]
        return [pid for pid, name in owned if pid and pid_alive(pid) and _cmdline_has(pid, name)]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: it has exited, only unreaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # Reap our own children (the exporter when `start` ran in this process).
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until every pid has exited; return those still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if p and pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def _cmdline_has(pid: int, needle: str) -> bool:
    # A pid recorded before a reboot may now belong to an unrelated process.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc (macOS): trust the pid
    return needle.encode() in cmdline


def read_pidfile(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
