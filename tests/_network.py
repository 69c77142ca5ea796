"""A Redis server across a network with a chosen round trip, for tests and benchmarks: two network
namespaces joined by a veth pair, a real ``redis-server`` in the server's, and a delay relay
(``_delay_relay.py``) in front of it for each round trip asked for.

    with FarServer(workdir, rtts_ms=(50, 100)) as far:
        subprocess.run([*far.client_prefix, sys.executable, "job.py"], env={..., "URL": far.url(100)})

The kernel's ``netem`` may be missing (it is on the machines this was written on), so the delay is
the relay's, not the kernel's: it holds each chunk for half the round trip in each direction, and
charges the TCP handshake's round trip to a connection's first bytes. Bandwidth is not limited.

Needs root and ``ip netns``: :func:`netns_skip_reason` says why it cannot run, :func:`require_netns`
skips the calling test with that reason. Namespace names are unique and carry the creating process's
id, so a namespace left by a killed earlier run is no obstacle; :func:`remove_stale_namespaces`
removes those whose creator is gone and that hold no process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from warmstart.server.state import pid_alive

T = TypeVar("T")

RELAY = Path(__file__).resolve().parent / "_delay_relay.py"
REDIS_PORT = 6379  # each server namespace is new: nothing else listens in it
RELAY_BASE_PORT = 7000  # the relay for the i-th round trip listens on RELAY_BASE_PORT + i
NAME = re.compile(r"^ws-(?:srv|cli)-(\d+)-[0-9a-f]+$")
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


@functools.cache
def netns_skip_reason() -> str | None:
    """Why :class:`FarServer` cannot run here (not root, no ``ip``, ``ip netns add`` fails, no
    ``redis-server``), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if shutil.which("redis-server") is None:
        return "redis-server not found on PATH"
    probe = f"ws-probe-{os.getpid()}-{secrets.token_hex(3)}"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"ip netns add fails: {added.stderr.strip() or added.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    """Skip the calling test, with the reason, where network namespaces cannot be used."""
    import pytest

    reason = netns_skip_reason()
    if reason is not None:
        pytest.skip(reason)


def namespaces() -> list[str]:
    """Names of the network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def namespace_pids(name: str) -> list[int]:
    """Processes in network namespace ``name``."""
    result = _ip("netns", "pids", name, check=False)
    return [int(pid) for pid in result.stdout.split()]


def remove_stale_namespaces() -> list[str]:
    """Remove this harness's namespaces whose creating process is gone and that hold no process
    (left by a run that was killed); returns their names. Any other namespace is left alone."""
    removed = []
    for name in namespaces():
        match = NAME.match(name)
        stale = match is not None and not pid_alive(int(match.group(1))) and not namespace_pids(name)
        if stale and _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


def in_namespace(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread of this process moved into network namespace ``name``: the sockets
    it opens belong there and stay there, so make a client inside ``fn`` and use it there (a pool
    that connects later, from another thread, would connect from this process's own namespace)."""
    libc = ctypes.CDLL(None, use_errno=True)
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
            finally:
                os.close(fd)
            outcome["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _die_with_parent() -> None:
    # In the child before exec (``ip netns exec`` execs the program in place): SIGKILL when the
    # harness's process dies, so a killed run leaves no server or relay behind, only an empty
    # namespace that remove_stale_namespaces() can remove.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class FarServer:
    """A ``redis-server`` in a network namespace of its own, reached from a client namespace across
    a veth pair, directly (round trip 0) or through a delay relay per round trip in ``rtts_ms``.
    Start with ``start()`` or ``with``; ``stop()`` removes the namespaces, the veth pair and every
    process in them, also when the body raised."""

    def __init__(self, workdir: Path, rtts_ms: Iterable[float] = (), *, handshake: bool = True) -> None:
        self.workdir = Path(workdir)
        self.rtts_ms = [float(rtt) for rtt in rtts_ms if float(rtt) > 0]
        self.handshake = handshake
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.server_ns = f"ws-srv-{tag}"
        self.client_ns = f"ws-cli-{tag}"
        # A random private /30; the addresses live only in the two namespaces, so they cannot clash
        # with the host's, only make a clash between two runs' logs less confusing.
        a, b, c = secrets.randbelow(256), secrets.randbelow(256), secrets.randbelow(64) * 4
        self.server_ip = f"10.{a}.{b}.{c + 1}"
        self.client_ip = f"10.{a}.{b}.{c + 2}"
        self.redis: subprocess.Popen | None = None
        self.relay: subprocess.Popen | None = None
        self._created: list[str] = []

    # -- what clients use ------------------------------------------------------------------

    @property
    def server_prefix(self) -> list[str]:
        """Run a command in the server's namespace: ``[*far.server_prefix, program, ...]``."""
        return ["ip", "netns", "exec", self.server_ns]

    @property
    def client_prefix(self) -> list[str]:
        """Run a command in the client's namespace (the environment passes through)."""
        return ["ip", "netns", "exec", self.client_ns]

    @property
    def local_url(self) -> str:
        """The server for a process in its own namespace (loopback, no delay): a cache's producer."""
        return f"redis://127.0.0.1:{REDIS_PORT}/0"

    def url(self, rtt_ms: float = 0) -> str:
        """The server for a client in the client namespace, ``rtt_ms`` away: 0 is straight across
        the veth pair, any other one of ``rtts_ms`` goes through its relay."""
        if rtt_ms <= 0:
            return f"redis://{self.server_ip}:{REDIS_PORT}/0"
        try:
            index = self.rtts_ms.index(float(rtt_ms))
        except ValueError:
            raise ValueError(f"no relay for a round trip of {rtt_ms} ms; started with {self.rtts_ms}") from None
        return f"redis://{self.server_ip}:{RELAY_BASE_PORT + index}/0"

    def in_client(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread in the client namespace (see :func:`in_namespace`)."""
        return in_namespace(self.client_ns, fn)

    def in_server(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread in the server namespace (see :func:`in_namespace`)."""
        return in_namespace(self.server_ns, fn)

    # -- start and stop --------------------------------------------------------------------

    def start(self) -> FarServer:
        reason = netns_skip_reason()
        if reason is not None:
            raise RuntimeError(f"FarServer cannot run here: {reason}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        remove_stale_namespaces()
        try:
            self._network()
            self._start_redis()
            if self.rtts_ms:
                self._start_relay()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        for name in (self.server_ns, self.client_ns):
            _ip("netns", "add", name)
            self._created.append(name)
        # Both ends are made inside their namespaces: no name is ever taken in the host's.
        _ip(
            "link",
            "add",
            "veth-srv",
            "netns",
            self.server_ns,
            "type",
            "veth",
            "peer",
            "veth-cli",
            "netns",
            self.client_ns,
        )
        for ns, dev, address in (
            (self.server_ns, "veth-srv", self.server_ip),
            (self.client_ns, "veth-cli", self.client_ip),
        ):
            _ip("-n", ns, "addr", "add", f"{address}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _start_redis(self) -> None:
        # The flags of _redis.RedisNode; bound to the veth address and loopback, and without protected
        # mode, which refuses every client but loopback's when there is no password.
        args = [
            *self.server_prefix,
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(REDIS_PORT),
            "--bind",
            self.server_ip,
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            "redis.log",
        ]
        self.redis = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        self.in_server(self._wait_redis)

    def _wait_redis(self, timeout: float = 10.0) -> None:
        import redis

        deadline = time.monotonic() + timeout  # hang guard for start-up, not a speed check
        while True:
            client = redis.Redis(host="127.0.0.1", port=REDIS_PORT, socket_connect_timeout=0.2)
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                if self.redis is not None and self.redis.poll() is not None:
                    log = self.workdir / "redis.log"
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited with {self.redis.returncode}:\n{tail}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
            finally:
                client.close()

    def _start_relay(self) -> None:
        args = [*self.server_prefix, sys.executable, str(RELAY), "--upstream", f"127.0.0.1:{REDIS_PORT}"]
        for i, rtt in enumerate(self.rtts_ms):
            args += ["--listen", f"{self.server_ip}:{RELAY_BASE_PORT + i}:{rtt:g}"]
        if not self.handshake:
            args.append("--no-handshake")
        log = open(self.workdir / "relay.log", "ab")
        try:
            self.relay = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, preexec_fn=_die_with_parent)
        finally:
            log.close()
        assert self.relay.stdout is not None
        # READY, or EOF when it failed; the wait is a hang guard, not a speed check.
        ready, _, _ = select.select([self.relay.stdout], [], [], 30)
        line = self.relay.stdout.readline() if ready else b""
        self.relay.stdout.close()
        if line.strip() != b"READY":
            _stop(self.relay)
            tail = (self.workdir / "relay.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the delay relay did not start (exit {self.relay.returncode}):\n{tail}")

    def stop(self) -> None:
        """Stop the relay and the server, kill whatever else runs in the namespaces (jobs started
        with a prefix) and remove the namespaces, which takes the veth pair with them."""
        _stop(self.relay)
        _stop(self.redis)
        for name in self._created:
            for pid in namespace_pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10  # hang guard: a killed process leaves at once
            while namespace_pids(name) and time.monotonic() < deadline:
                time.sleep(0.02)
            _ip("netns", "del", name, check=False)
        self._created.clear()

    def __enter__(self) -> FarServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
