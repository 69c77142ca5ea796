"""Fixtures for the cache-server tests: real ``warmstart server`` instances in temporary directories
on free ports (from ``_redis.py``), always stopped afterwards, and a self-signed TLS certificate made
with openssl."""

from __future__ import annotations

import subprocess

import pytest
from _redis import free_port_block, require_redis_server

from warmstart.server import ServerOptions, start, stop

MIB = 1024**2

#: The server tests that run without redis-server: rendered templates, checks made before the binary
#: is looked up, and a missing or bad binary itself. Every other test here starts a server, so it is
#: skipped (with the reason) where redis-server is missing, and fails under CI.
RUN_WITHOUT_REDIS_SERVER = frozenset(
    {
        "test_redis_conf_template_names_every_generated_directive",
        "test_acl_template_is_the_generated_acl_with_placeholders",
        "test_systemd_unit_runs_a_valid_start_command",
        "test_container_examples_run_valid_start_commands",
        "test_cluster_bus_beyond_loopback_needs_tls",
        "test_cluster_bus_check_accepts_loopback_or_tls",
        "test_missing_redis_server",
        "test_bad_redis_server_override",
        "test_status_of_a_directory_never_used",
        "test_rotate_needs_something_to_rotate",
    }
)


@pytest.fixture(autouse=True)
def _redis_server_binary(request):
    """Skip (or, under CI, fail) a server-starting test where redis-server is missing."""
    if request.node.originalname not in RUN_WITHOUT_REDIS_SERVER:
        require_redis_server()


@pytest.fixture
def server_dir(tmp_path):
    """A server directory; whatever was started from it is stopped after the test."""
    directory = tmp_path / "server"
    yield directory
    stop(directory)


@pytest.fixture(scope="module")
def single_server(tmp_path_factory):
    """One node (32 MiB, plaintext) shared by a module's read-only checks."""
    require_redis_server()
    directory = tmp_path_factory.mktemp("single") / "server"
    state = start(ServerOptions(dir=directory, port=free_port_block(1), maxmemory=32 * MIB))
    yield state
    stop(directory)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1/localhost and its key."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key
