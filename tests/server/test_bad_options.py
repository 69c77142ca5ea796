"""Bad ``warmstart server start`` options: one clear line each on stderr, exit code 2, nothing left
running."""

from __future__ import annotations

import socket

import pytest
from _redis import free_port_block
from click.testing import CliRunner

from warmstart.cli import cli
from warmstart.server import ServerState


def _start(*args: str):
    return CliRunner().invoke(cli, ["server", "start", *args])


def _assert_one_line(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_port_in_use(server_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _start("--dir", str(server_dir), "--port", str(port))
    _assert_one_line(result, "--port", str(port), "already in use")
    assert ServerState.load(server_dir) is None


def test_cluster_bus_port_in_use(server_dir):
    base = free_port_block(3, bus=True)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 1 + 10000))
        busy.listen()
        result = _start("--dir", str(server_dir), "--port", str(base), "--cluster", "3")
    _assert_one_line(result, "Cluster bus port", str(base + 10001), "already in use")


def test_unwritable_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # A path under a regular file cannot be created, even by root (chmod would not stop root).
    result = _start("--dir", str(blocker / "server"), "--port", str(free_port_block(1)))
    _assert_one_line(result, "--dir", "not writable")


def test_server_dir_variable_is_the_default_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("WARMSTART_SERVER_DIR", str(blocker / "server"))
    result = _start("--port", str(free_port_block(1)))
    _assert_one_line(result, "--dir", str(blocker / "server"), "not writable")


def test_missing_redis_server(server_dir, monkeypatch, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("WARMSTART_REDIS_SERVER", raising=False)
    result = _start("--dir", str(server_dir), "--port", str(free_port_block(1)))
    _assert_one_line(result, "redis-server not found on PATH", "WARMSTART_REDIS_SERVER")


def test_bad_redis_server_override(server_dir, monkeypatch):
    monkeypatch.setenv("WARMSTART_REDIS_SERVER", "/nonexistent/redis-server")
    result = _start("--dir", str(server_dir), "--port", str(free_port_block(1)))
    _assert_one_line(result, "WARMSTART_REDIS_SERVER", "/nonexistent/redis-server")


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--maxmemory", "lots"], ["--maxmemory", "'lots'", "10GiB"]),
        (["--maxmemory", "0"], ["--maxmemory"]),
        (["--maxmemory", "100"], ["--maxmemory", "16MiB per node"]),
        (["--maxmemory", "40MiB", "--cluster", "3"], ["--maxmemory", "16MiB per node"]),
        (["--cluster", "2"], ["--cluster", "at least 3"]),
        (["--port", "70000"], ["--port", "between 1 and 65535"]),
        (["--tls-cert", "/nonexistent/cert.pem"], ["--tls-cert needs --tls-key"]),
        (
            ["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"],
            ["--tls-cert", "cannot be read"],
        ),
        (["--bind", "203.0.113.7"], ["--bind", "203.0.113.7"]),
    ],
)
def test_bad_values(server_dir, args, fragments):
    result = (
        _start("--dir", str(server_dir), "--port", str(free_port_block(1)), *args)
        if "--port" not in args
        else _start("--dir", str(server_dir), *args)
    )
    _assert_one_line(result, *fragments)


def test_tls_file_that_is_not_pem(server_dir, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("hello")
    result = _start(
        "--dir", str(server_dir), "--port", str(free_port_block(1)), "--tls-cert", str(junk), "--tls-key", str(junk)
    )
    _assert_one_line(result, "--tls-cert", "not a PEM file")
