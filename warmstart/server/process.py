"""Lifecycle of the cache server's processes: start, run in the foreground, stop.

This module owns turning :class:`ServerOptions` into running ``redis-server`` processes: it writes
the ACL file and each node's ``redis.conf`` under ``--dir``, launches the nodes (daemonized by
Redis itself, or as children of a foreground supervisor), returns only once every node answers
``PING`` (and, for a Cluster, once the Cluster serves every slot), records pids in ``state.json``,
and starts the metrics exporter when asked. ``stop`` shuts nodes down through the admin user and
waits until every process has exited. A start that fails half-way stops what it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from warmstart.errors import WarmstartError
from warmstart.server import cluster, preflight
from warmstart.server.acl import render_acl_file
from warmstart.server.config import ACL_FILE, URL_FILES, ServerOptions, node_dir, render_redis_conf
from warmstart.server.credentials import Credentials, write_private
from warmstart.server.state import ServerState, pid_alive, read_pidfile, wait_gone

_READY_TIMEOUT_S = 15.0  # a node that has not answered PING by then is reported as failed
_STOP_TIMEOUT_S = 10.0  # SHUTDOWN, then SIGTERM, then after this long SIGKILL


def start(options: ServerOptions) -> ServerState:
    """Start a daemonized server; return once it answers. Its processes outlive this one.

    Raises:
        ConfigError: a bad option or a machine check failed (see ``preflight``).
        WarmstartError: a node did not start or the Cluster did not form.
    """
    state, credentials, redis_server, redis_cli = _prepare(options, daemonize=True)
    try:
        for index in range(len(options.ports)):
            conf = node_dir(options, index) / "redis.conf"
            done = subprocess.run([redis_server, str(conf)], capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise WarmstartError(f"redis-server did not start: {_last_line(done.stderr + done.stdout)}")
        for index in range(len(options.ports)):
            state.pids.append(_wait_ready(state, credentials, index, proc=None))
        _finish(state, credentials, redis_cli)
        if options.metrics_port:
            state.exporter_pid = _spawn_exporter(options)
    except BaseException:
        _abort(state)
        raise
    state.started_at = time.time()
    state.save()
    return state


def run_foreground(options: ServerOptions, on_ready: Callable[[ServerState], None]) -> int:
    """Run the server as children of this process until SIGTERM/SIGINT or a node dies.

    ``on_ready`` is called once every node answers. Returns the exit code: 0 after a requested
    stop, 1 when a node exited on its own.

    Raises:
        ConfigError: a bad option or a machine check failed.
        WarmstartError: a node did not start or the Cluster did not form.
    """
    state, credentials, redis_server, redis_cli = _prepare(options, daemonize=False)
    procs: list[subprocess.Popen] = []
    stop_requested = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop_requested.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    exporter = None
    try:
        for index in range(len(options.ports)):
            conf = node_dir(options, index) / "redis.conf"
            procs.append(
                subprocess.Popen(
                    [redis_server, str(conf)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        state.pids = [_wait_ready(state, credentials, i, proc=p) for i, p in enumerate(procs)]
        _finish(state, credentials, redis_cli)
        if options.metrics_port:
            from warmstart.server.metrics import MetricsServer

            exporter = MetricsServer(options.dir, _listen_host(options), options.metrics_port)  # serving now
        state.supervisor_pid = os.getpid()
        state.started_at = time.time()
        state.save()
        on_ready(state)
        while not stop_requested.wait(0.2):
            if any(p.poll() is not None for p in procs):
                return 1
        return 0
    finally:
        if exporter is not None:
            exporter.shutdown()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()  # Redis shuts down cleanly on SIGTERM (AOF flushed)
        for proc in procs:
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        state.pids, state.supervisor_pid = [], 0
        state.save()


def stop(directory: Path, timeout: float = _STOP_TIMEOUT_S) -> list[int]:
    """Stop the server started from ``directory`` and wait until its processes have exited.

    Returns the pids that were running (empty when nothing was).

    Raises:
        WarmstartError: a process survived SIGKILL.
    """
    state = ServerState.load(directory)
    if state is None:
        return []
    running = state.running_pids()
    if state.supervisor_pid in running:
        os.kill(state.supervisor_pid, signal.SIGTERM)  # the supervisor stops its own children
        wait_gone([state.supervisor_pid], timeout)
    try:
        credentials = Credentials.load(directory)
    except OSError:
        credentials = None
    for port, pid in zip(state.options.ports, state.pids, strict=False):
        if not pid or pid not in running or not pid_alive(pid):
            continue
        if not _shutdown(state, credentials, port):
            _signal(pid, signal.SIGTERM)
    if state.exporter_pid in running:
        _signal(state.exporter_pid, signal.SIGTERM)
    left = wait_gone(running, timeout)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    left = wait_gone(left, 5.0)
    if left:
        raise WarmstartError(f"processes {left} of the server in {directory} did not exit")
    state.pids, state.exporter_pid, state.supervisor_pid = [], 0, 0
    state.save()
    return running


def reload_acl(directory: Path, old: Credentials, new: Credentials) -> int:
    """Make the server in ``directory`` take ``new`` passwords now, without a restart: rewrite the
    ACL file and the URL files, then ``ACL LOAD`` on every node (authenticated with ``old``).
    Redis closes the connections of users whose rules were reloaded; clients reconnect, and
    only those with the new password get back in. Returns the number of nodes reloaded (0 if
    none runs).

    Raises:
        WarmstartError: a running node refused the new ACL file.
    """
    import redis

    write_private(directory / ACL_FILE, render_acl_file(new.passwords))
    state = ServerState.load(directory)
    if state is None:
        return 0
    for user, name in URL_FILES.items():
        write_private(directory / name, state.url(user, new) + "\n")
    reloaded = 0
    for port, pid in zip(state.options.ports, state.pids, strict=False):
        if not pid or not pid_alive(pid):
            continue
        client = state.client(port, credentials=old)
        try:
            client.execute_command("ACL", "LOAD")
            reloaded += 1
        except redis.RedisError as exc:
            raise WarmstartError(f"node {state.options.host}:{port} did not reload the ACL file: {exc}") from None
        finally:
            client.close()
    return reloaded


# -- helpers ----------------------------------------------------------------------------------


def _prepare(options: ServerOptions, *, daemonize: bool) -> tuple[ServerState, Credentials, str, str | None]:
    redis_server, redis_cli = preflight.run_all(options)
    credentials = Credentials.load_or_create(options.dir)
    write_private(options.dir / ACL_FILE, render_acl_file(credentials.passwords))
    previous = ServerState.load(options.dir)
    for index in range(len(options.ports)):
        ndir = node_dir(options, index)
        ndir.mkdir(mode=0o700, exist_ok=True)
        (ndir / "redis.pid").unlink(missing_ok=True)
        if previous is None or _layout(previous.options) != _layout(options):
            # Cluster membership recorded for other ports or another size cannot be reused.
            (ndir / "nodes.conf").unlink(missing_ok=True)
        write_private(ndir / "redis.conf", render_redis_conf(options, index, daemonize=daemonize))
    state = ServerState(options=options)
    for user, name in URL_FILES.items():
        write_private(options.dir / name, state.url(user, credentials) + "\n")
    return state, credentials, redis_server, redis_cli


def _layout(options: ServerOptions) -> tuple:
    return (options.cluster, tuple(options.ports), options.host, options.tls)


def _wait_ready(state: ServerState, credentials: Credentials, index: int, proc: subprocess.Popen | None) -> int:
    """Wait until node ``index`` answers PING as admin; return its pid."""
    import redis

    port = state.options.ports[index]
    ndir = node_dir(state.options, index)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    client = state.client(port, credentials=credentials)
    try:
        while True:
            pid = proc.pid if proc is not None else read_pidfile(ndir / "redis.pid")
            try:
                if client.ping():
                    return pid or read_pidfile(ndir / "redis.pid")
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            exited = proc.poll() is not None if proc is not None else (pid and not pid_alive(pid))
            if exited or time.monotonic() > deadline:
                stderr = proc.stderr.read() if proc is not None and exited and proc.stderr else ""
                reason = _last_line(stderr) or _log_reason(ndir / "redis.log") or "no answer to PING"
                raise WarmstartError(f"redis-server on port {port} did not start: {reason} (log: {ndir / 'redis.log'})")
            time.sleep(0.02)
    finally:
        client.close()


def _finish(state: ServerState, credentials: Credentials, redis_cli: str | None) -> None:
    if state.options.cluster:
        assert redis_cli is not None
        cluster.form(state, credentials, redis_cli)


def _spawn_exporter(options: ServerOptions) -> int:
    """Start the metrics exporter as its own session, so it outlives this process."""
    host = _listen_host(options)
    log = open(options.dir / "metrics.log", "ab")  # noqa: SIM115 (closed below, once the exporter has it)
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "warmstart.server.metrics",
                "--dir",
                str(options.dir),
                "--host",
                host,
                "--port",
                str(options.metrics_port),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    finally:
        log.close()
    from warmstart.server.metrics import wait_listening

    if not wait_listening(host, options.metrics_port or 0, proc, timeout=_READY_TIMEOUT_S):
        raise WarmstartError(
            f"the metrics exporter did not start on port {options.metrics_port} (log: {options.dir / 'metrics.log'})"
        )
    return proc.pid


def _listen_host(options: ServerOptions) -> str:
    # The exporter listens on the first bind address ("-" marks an optional one in redis.conf).
    host = options.bind.split()[0].lstrip("-")
    return "0.0.0.0" if host == "*" else host


def _shutdown(state: ServerState, credentials: Credentials | None, port: int) -> bool:
    import redis

    if credentials is None:
        return False
    client = state.client(port, credentials=credentials)
    try:
        # NOSAVE skips an RDB snapshot (there is none by design); AOF is still flushed.
        client.shutdown(nosave=not state.options.aof)
        return True
    except redis.RedisError:
        return False
    finally:
        client.close()


def _abort(state: ServerState) -> None:
    pids = [p for p in state.pids if p]
    for index in range(len(state.options.ports)):
        pid = read_pidfile(node_dir(state.options, index) / "redis.pid")
        if pid and pid not in pids:
            pids.append(pid)
    if state.exporter_pid:
        pids.append(state.exporter_pid)
    for pid in pids:
        if pid_alive(pid):
            _signal(pid, signal.SIGTERM)
    for pid in wait_gone(pids, _STOP_TIMEOUT_S):
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("*** FATAL CONFIG FILE ERROR")]
    return lines[-1] if lines else ""


def _log_reason(log: Path) -> str:
    """The last warning/error line of a Redis log (lines marked ``#``), without its prefix."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if " # " in line:
            return line.split(" # ", 1)[1].strip()
    return ""
