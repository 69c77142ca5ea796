"""Checks a start request against this machine before anything is launched.

This module owns the "one clear line" failures of ``warmstart server start``: ``redis-server`` (or
``redis-cli`` for a Cluster) not found, a directory that cannot be written, a port already in use,
a TLS file that cannot be read, a server already running from the same directory, a Cluster bus
other hosts could reach without TLS. Each raises
:class:`~warmstart.errors.ConfigError` (exit code 2) naming the option, the value and what is
accepted. It launches nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

from warmstart.config import server_settings
from warmstart.errors import ConfigError
from warmstart.server.config import CLUSTER_BUS_OFFSET, OptionError, ServerOptions, is_loopback
from warmstart.server.state import ServerState

log = logging.getLogger("warmstart.server")


def redis_binary(name: str = "redis-server", environ: Mapping[str, str] | None = None) -> str:
    """Path of ``redis-server`` (``$WARMSTART_REDIS_SERVER`` first) or ``redis-cli``
    (``$WARMSTART_REDIS_CLI``, then next to redis-server, then ``$PATH``).

    Raises:
        ConfigError: the override does not name an executable, or nothing is found on ``PATH``.
    """
    env = os.environ if environ is None else environ
    settings = server_settings(env)
    variable = "WARMSTART_REDIS_SERVER" if name == "redis-server" else "WARMSTART_REDIS_CLI"
    override = settings.redis_server if name == "redis-server" else settings.redis_cli
    if override:
        found = shutil.which(override, path=env.get("PATH"))
        if not found:
            raise ConfigError(variable, override, f"the path of an executable {name}")
        return found
    if name == "redis-cli":
        server = redis_binary("redis-server", env)
        sibling = Path(server).with_name("redis-cli")
        if os.access(sibling, os.X_OK):
            return str(sibling)
    found = shutil.which(name, path=env.get("PATH"))
    if not found:
        raise OptionError(
            variable,
            None,
            name,
            f"{name} not found on PATH: install it (Debian: apt-get install "
            f"redis-server) or set {variable}=/path/to/{name}",
        )
    return found


def check_dir(directory: Path) -> None:
    """Create ``directory`` (mode 0700) if needed and check that files can be written in it, and that
    no one else can: the signing key and the passwords live there.

    A directory of this user's that others could write is made private again (0700, one warning).
    One that another user owns, or that holds a file another user owns or can write (a key planted
    while the directory was open), is refused.

    Raises:
        ConfigError: it cannot be created or written, or others own it or files in it.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        _check_private(directory)
        probe = directory / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OptionError(
            "--dir",
            str(directory),
            "a writable directory",
            f"--dir={str(directory)!r} is not writable ({reason}): expected a directory this user can create files in",
        ) from None


def _check_private(directory: Path) -> None:
    uid = os.geteuid()
    st = directory.stat()
    if st.st_uid != uid:
        raise OptionError(
            "--dir",
            str(directory),
            "a directory of this user's",
            f"--dir={str(directory)!r} belongs to uid {st.st_uid}, not to this user (uid {uid}): "
            "its keys and passwords would not be this user's alone; use a directory of your own",
        )
    for path in directory.iterdir():
        found = path.lstat() if path.is_symlink() else path.stat()
        if found.st_uid != uid or (not path.is_dir() and found.st_mode & 0o022):
            raise OptionError(
                "--dir",
                str(directory),
                "a directory whose files are this user's alone",
                f"--dir={str(directory)!r} holds {path.name}, which another user owns or can write: "
                "it may have been replaced; check it, remove it, and start again",
            )
    if st.st_mode & 0o077:
        log.warning(
            "warmstart: --dir %s was open to others (mode %o): made private (0700)", directory, st.st_mode & 0o7777
        )
        os.chmod(directory, 0o700)


def check_not_running(directory: Path) -> None:
    """Refuse to start a second server from the same directory.

    Raises:
        ConfigError: processes recorded in the directory's state are still alive.
    """
    state = ServerState.load(directory)
    alive = state.running_pids() if state else []
    if alive:
        raise OptionError(
            "--dir",
            str(directory),
            "a directory no running server uses",
            f"--dir={str(directory)!r} is in use: a server started from it is running (pid "
            f"{', '.join(map(str, alive))}); stop it first: warmstart server stop --dir {directory}",
        )


def check_ports(options: ServerOptions) -> None:
    """Check that every port the server will listen on is free on the bind address.

    Raises:
        ConfigError: a port is in use (the flag that chose it is named).
    """
    wanted = [("--port", p) for p in options.ports]
    if options.cluster:
        wanted += [("--port", p + CLUSTER_BUS_OFFSET) for p in options.ports]
    if options.metrics_port:
        wanted.append(("--metrics-port", options.metrics_port))
    address = options.bind.split()[0].lstrip("-")
    address = "0.0.0.0" if address == "*" else address
    for flag, port in wanted:
        error = _bind_error(address, port)
        if error == errno.EADDRINUSE:
            what = "Cluster bus port" if port not in options.ports and flag == "--port" else "port"
            raise OptionError(
                flag,
                port,
                "a free port",
                f"{flag}: {what} {port} on {address} is already in use; choose another "
                f"{flag} or stop what listens there",
            )
        if error is not None:
            raise OptionError(
                "--bind",
                options.bind,
                "an address of this machine",
                f"--bind={options.bind!r} cannot be listened on ({os.strerror(error)}): "
                "expected an address of this machine, e.g. 127.0.0.1 or 0.0.0.0",
            )


def check_tls_files(options: ServerOptions) -> None:
    """Check that the certificate, key and CA files can be read.

    Raises:
        ConfigError: a file is missing or unreadable.
    """
    for flag, path in (("--tls-cert", options.tls_cert), ("--tls-key", options.tls_key), ("--tls-ca", options.tls_ca)):
        if path is None:
            continue
        try:
            with open(path, "rb") as handle:
                head = handle.read(4096)
        except OSError as exc:
            raise OptionError(
                flag,
                str(path),
                "a readable PEM file",
                f"{flag}={str(path)!r} cannot be read ({exc.strerror}): expected a PEM file",
            ) from None
        if b"-----BEGIN" not in head:
            raise OptionError(flag, str(path), "a PEM file", f"{flag}={str(path)!r} is not a PEM file")


def check_cluster_bus(options: ServerOptions) -> None:
    """Refuse a Cluster whose bus other hosts could reach without TLS.

    Redis 7.0's Cluster bus (port+10000) has no authentication: whoever reaches it can join the
    Cluster and take its slots. With TLS (``tls-cluster yes``) the bus demands a client certificate
    signed by the CA; without TLS the Cluster must listen on loopback addresses only. Checked at
    start, not when options are read back, so ``stop`` still works on a server started before.

    Raises:
        ConfigError: ``--cluster`` with a non-loopback ``--bind`` and no TLS.
    """
    if options.cluster and not options.tls and not is_loopback(options.bind):
        raise OptionError(
            "--bind",
            options.bind,
            "a loopback address with --cluster, or TLS",
            f"--cluster with --bind={options.bind!r} would expose the Cluster bus (port+"
            f"{CLUSTER_BUS_OFFSET}), which Redis does not authenticate: add --tls-cert/--tls-key "
            "(the bus then requires the CA's client certificates) or use --bind 127.0.0.1",
        )


def run_all(options: ServerOptions) -> tuple[str, str | None]:
    """Every check, cheapest first; returns the redis-server and (for a Cluster) redis-cli paths."""
    check_cluster_bus(options)
    server = redis_binary("redis-server")
    cli = redis_binary("redis-cli") if options.cluster else None
    check_dir(options.dir)
    check_not_running(options.dir)
    check_tls_files(options)
    check_ports(options)
    return server, cli


def _bind_error(address: str, port: int) -> int | None:
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return errno.EADDRNOTAVAIL
    family, socktype, proto, _, sockaddr = infos[0]
    with socket.socket(family, socktype, proto) as sock:
        # Redis sets SO_REUSEADDR too: a port held only by TIME_WAIT sockets is free for it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            return exc.errno
    return None
