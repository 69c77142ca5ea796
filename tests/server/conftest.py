"""Fixtures for the cache-server tests: real ``warmstart server`` instances in temporary directories
on free ports, always stopped afterwards, and a self-signed TLS certificate made with openssl."""

from __future__ import annotations

import subprocess

import pytest
from _ports import free_port_block

from warmstart.server import ServerOptions, start, stop

MIB = 1024**2


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
