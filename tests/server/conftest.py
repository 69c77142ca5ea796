"""Fixtures for the cache-server tests: real ``warmstart server`` instances in temporary directories
on free ports, always stopped afterwards, and a self-signed TLS certificate made with openssl."""

from __future__ import annotations

import random
import socket
import subprocess

import pytest

from warmstart.server import ServerOptions, start, stop

MIB = 1024**2


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int, *, bus: bool = False) -> int:
    """A base port such that base..base+n-1 (and their Cluster bus ports, +10000) are free."""
    for _ in range(200):
        base = random.randrange(20000, 40000)
        ports = [base + i for i in range(n)] + ([base + i + 10000 for i in range(n)] if bus else [])
        if all(port_is_free(p) for p in ports):
            return base
    raise RuntimeError("no free block of ports")


@pytest.fixture
def server_dir(tmp_path):
    """A server directory; whatever was started from it is stopped after the test."""
    directory = tmp_path / "server"
    yield directory
    stop(directory)


@pytest.fixture(scope="module")
def single_server(tmp_path_factory):
    """One node (32 MiB, plaintext) shared by a module's read-only checks."""
    directory = tmp_path_factory.mktemp("single") / "server"
    state = start(ServerOptions(dir=directory, port=free_port_block(1), maxmemory=32 * MIB))
    yield state
    stop(directory)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1/localhost and its key."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key
