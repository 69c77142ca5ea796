"""A ``--cluster 3`` server serves hits to the store across its nodes; TLS works and a plaintext
client is refused when TLS is on."""

from __future__ import annotations

import json
import os

import pytest
import redis
from _cli import start_json as _start_json
from _redis import free_port_block
from click.testing import CliRunner
from redis.backoff import NoBackoff
from redis.retry import Retry

from warmstart._defaults import INLINE_BYTES
from warmstart.cli import cli
from warmstart.compile_cache import signing
from warmstart.compile_cache.remote import RemoteTier
from warmstart.server import Credentials, ServerState


def test_cluster_of_three_serves_store_hits(server_dir):
    base = free_port_block(3, bus=True)
    info = _start_json("--dir", str(server_dir), "--port", str(base), "--cluster", "3", "--maxmemory", "48MiB")
    hosts = ",".join(f"127.0.0.1:{base + i}" for i in range(3))
    assert info["writer_url"].startswith("redis+cluster://writer:") and info["writer_url"].endswith("@" + hosts)
    assert info["reader_url"].startswith("redis+cluster://reader:")
    secret = open(info["secret_file"], "rb").read().strip()

    values = {f"k{i}": os.urandom(500 + 3000 * i) for i in range(30)}
    writer = RemoteTier(info["writer_url"], secret=secret, namespace="cluster-test")
    for key, value in values.items():
        assert writer.put("fx_graph", key, value)
    # A different client (another job) reads every entry back with the read-only credentials.
    reader = RemoteTier(info["reader_url"], secret=secret, namespace="cluster-test")
    for key, value in values.items():
        assert reader.get("fx_graph", key).value == value
    counts = reader.stats.to_dict()["remote"]["fx_graph"]
    assert counts["hits"] == 30 and counts["misses"] == 0 and counts["errors"] == 0
    assert reader.put("fx_graph", "k-new", b"x") is False

    status = json.loads(CliRunner().invoke(cli, ["server", "status", "--dir", str(server_dir), "--json"]).stdout)
    assert status["up"] is True and status["mode"] == "cluster" and status["nodes_up"] == 3
    blobs = sum(len(value) > INLINE_BYTES for value in values.values())  # larger values get a blob key
    assert (
        blobs > 0 and status["keys"] == 30 + blobs + 1 and sum(n["keys"] > 0 for n in status["nodes"]) >= 2
    )  # spread over the nodes
    assert status["maxmemory"] == 48 * 1024**2 and all(n["maxmemory"] == 16 * 1024**2 for n in status["nodes"])
    assert status["namespace_bytes"]["cluster-test"] > sum(map(len, values.values()))

    # The writer's rights are the same on every node: no FLUSHALL, no CLUSTER RESET.
    state = ServerState.load(server_dir)
    creds = Credentials.load(server_dir)
    for port in state.options.ports:
        client = state.client(port, "writer", creds)
        for command in (("FLUSHALL",), ("CLUSTER", "RESET"), ("CONFIG", "GET", "*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)

    result = CliRunner().invoke(cli, ["server", "stop", "--dir", str(server_dir)])
    assert result.exit_code == 0 and all(str(p) in result.stdout for p in state.pids)
    assert ServerState.load(server_dir).running_pids() == []

    # Started again from the same directory: the same Cluster (nodes.conf kept), the same URLs.
    again = _start_json("--dir", str(server_dir))
    assert again["writer_url"] == info["writer_url"] and again["mode"] == "cluster"
    writer = RemoteTier(again["writer_url"], secret=secret, namespace="cluster-test")
    assert writer.put("fx_graph", "after-restart", b"r" * 10_000)
    assert writer.get("fx_graph", "after-restart").value == b"r" * 10_000


def test_tls_works_and_plaintext_is_refused(server_dir, tls_files):
    cert, key = tls_files
    port = free_port_block(1)
    info = _start_json("--dir", str(server_dir), "--port", str(port), "--tls-cert", str(cert), "--tls-key", str(key))
    assert info["tls"] is True
    assert info["writer_url"].startswith("rediss://writer:") and f"ssl_ca_certs={cert}" in info["writer_url"]
    secret = open(info["secret_file"], "rb").read().strip()
    writer = RemoteTier(info["writer_url"], secret=secret, namespace="tls")
    assert writer.put("fx_graph", "k", b"over tls" * 100)
    assert (
        RemoteTier(info["reader_url"], secret=secret, namespace="tls").get("fx_graph", "k").value == b"over tls" * 100
    )

    no_retry = dict(retry=Retry(NoBackoff(), 0), socket_timeout=2, socket_connect_timeout=2)
    password = Credentials.load(server_dir).passwords["writer"]
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, username="writer", password=password, **no_retry).ping()
    # TLS without credentials is still anonymous: refused.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, ssl=True, ssl_ca_certs=str(cert), **no_retry).get("ws:x")
    # A client that does not trust the certificate does not connect.
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, ssl=True, username="writer", password=password, **no_retry).ping()

    status = json.loads(CliRunner().invoke(cli, ["server", "status", "--dir", str(server_dir), "--json"]).stdout)
    assert status["up"] is True and status["tls"] is True and status["keys"] == 2  # the entry; the index


@pytest.mark.parametrize("bind", ["0.0.0.0", "127.0.0.1 192.0.2.10", "::"])
def test_cluster_bus_beyond_loopback_needs_tls(server_dir, bind):
    """Redis 7.0's Cluster bus has no authentication: a plaintext Cluster must stay on loopback."""
    base = free_port_block(3, bus=True)
    result = CliRunner().invoke(
        cli, ["server", "start", "--dir", str(server_dir), "--port", str(base), "--cluster", "3", "--bind", bind]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Cluster bus" in lines[0] and "--tls-cert" in lines[0] and "127.0.0.1" in lines[0]
    assert ServerState.load(server_dir) is None


def test_cluster_bus_check_accepts_loopback_or_tls(tmp_path):
    from warmstart.server.config import ServerOptions
    from warmstart.server.preflight import check_cluster_bus

    for options in (
        dict(cluster=3),
        dict(cluster=3, bind="127.0.0.1 -::1"),
        dict(bind="0.0.0.0"),
        dict(cluster=3, bind="0.0.0.0", tls_cert="/c.pem", tls_key="/k.pem"),
    ):
        check_cluster_bus(ServerOptions(dir=tmp_path, **options))


def test_tls_cluster_serves_the_store_and_its_bus_wants_a_client_certificate(server_dir, tls_files):
    import socket
    import ssl

    cert, key = tls_files
    base = free_port_block(3, bus=True)
    info = _start_json(
        "--dir",
        str(server_dir),
        "--port",
        str(base),
        "--cluster",
        "3",
        "--maxmemory",
        "48MiB",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    )
    assert info["writer_url"].startswith("rediss+cluster://writer:")
    conf = (server_dir / "node0" / "redis.conf").read_text().splitlines()
    assert "tls-cluster yes" in conf and "port 0" in conf
    keys = signing.load_key_file(info["signing_key_file"])
    writer = RemoteTier(info["writer_url"], keys=keys, namespace="tls-cluster")
    values = {f"k{i}": os.urandom(1000 + 40_000 * i) for i in range(6)}
    for name, value in values.items():
        assert writer.put("fx_graph", name, value)
    reader = RemoteTier(
        info["reader_url"], keys=signing.load_key_file(info["verify_key_file"]), namespace="tls-cluster"
    )
    assert all(reader.get("fx_graph", name).value == value for name, value in values.items())

    bus = base + 10000
    # Plaintext on the bus: no Cluster message is accepted; the TLS server answers with at most an
    # alert and drops the connection.
    with socket.create_connection(("127.0.0.1", bus), timeout=5) as sock:
        sock.sendall(b"RCmb" + b"\0" * 64)
        try:
            answer = sock.recv(100)
        except OSError:
            answer = b""
        assert answer == b"" or answer[:1] == b"\x15", answer  # 0x15: a TLS alert record
    # TLS that trusts the server but shows no client certificate: refused.
    context = ssl.create_default_context(cafile=str(cert))
    context.check_hostname = False
    with (
        pytest.raises((ssl.SSLError, ConnectionError, OSError)),
        socket.create_connection(("127.0.0.1", bus), timeout=5) as raw,
        context.wrap_socket(raw) as tls,
    ):
        tls.sendall(b"RCmb" + b"\0" * 64)
        if not tls.recv(100):  # TLS 1.3 reports the missing certificate on the first read
            raise ConnectionError("closed")
    # With the nodes' certificate the bus does take the connection (mutual TLS, not a closed port).
    context.load_cert_chain(str(cert), str(key))
    with socket.create_connection(("127.0.0.1", bus), timeout=5) as raw, context.wrap_socket(raw) as tls:
        assert tls.version() is not None
