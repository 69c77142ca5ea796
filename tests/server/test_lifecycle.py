"""``warmstart server start|status|stop`` on real servers: status answers, stop stops, a restart from
the same directory keeps credentials (and, with AOF, data), foreground mode and the Prometheus
exporter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import redis
from _cli import start_json as _start_json
from _redis import free_port_block
from click.testing import CliRunner
from redis.backoff import NoBackoff
from redis.retry import Retry

from warmstart.cli import cli
from warmstart.compile_cache.remote import RemoteTier
from warmstart.server import Credentials, ServerState
from warmstart.server.state import pid_alive


def _run(*args: str):
    result = CliRunner().invoke(cli, ["server", *args])
    return result


def test_start_status_stop(server_dir):
    port = free_port_block(1)
    info = _start_json("--dir", str(server_dir), "--port", str(port), "--maxmemory", "16MiB")
    assert set(info) >= {
        "writer_url_file",
        "reader_url_file",
        "signing_key_file",
        "verify_key_file",
        "secret_file",
        "dir",
    }
    assert info["writer_url"].startswith("redis://writer:") and info["writer_url"].endswith(f"@127.0.0.1:{port}/0")
    assert info["reader_url"].startswith("redis://reader:")
    assert info["dir"] == str(server_dir)
    secret = open(info["secret_file"], "rb").read().strip()
    assert len(secret) == 64
    # Fill it through the store, read two back, miss once: the hit rate reflects it.
    tier = RemoteTier(info["writer_url"], secret=secret, namespace="team-a")
    for i in range(5):
        assert tier.put("fx_graph", f"k{i}", os.urandom(20_000))
    assert tier.get("fx_graph", "k0").value is not None and tier.get("fx_graph", "k1").value is not None
    assert tier.get("fx_graph", "missing").value is None
    other = RemoteTier(info["writer_url"], secret=secret, namespace="team-b")
    assert other.put("autotune", "k", os.urandom(1000))

    result = _run("status", "--dir", str(server_dir), "--json")
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["up"] is True and status["mode"] == "single"
    assert status["maxmemory"] == 16 * 1024**2
    # values up to 64 KiB live inline in their signed pointer: one key each, and each namespace's index
    assert status["keys"] == 6 + 2
    assert status["used_memory"] > 0
    assert status["keyspace_hits"] >= 2 and status["keyspace_misses"] >= 1
    assert 0 < status["hit_rate"] < 1
    assert status["evicted_keys"] == 0
    assert status["connected_clients"] >= 1
    assert status["namespace_bytes_exact"] is True
    assert status["namespace_bytes"]["team-a"] > 5 * 20_000 > status["namespace_bytes"]["team-b"] > 1000
    human = _run("status", "--dir", str(server_dir))
    assert human.exit_code == 0 and "UP" in human.stdout and "team-a" in human.stdout

    pid = ServerState.load(server_dir).pids[0]
    result = _run("stop", "--dir", str(server_dir))
    assert result.exit_code == 0 and str(pid) in result.stdout
    assert not pid_alive(pid)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=0.5).ping()
    down = _run("status", "--dir", str(server_dir), "--json")
    assert down.exit_code == 1 and json.loads(down.stdout)["up"] is False
    assert json.loads(down.stdout)["error"].startswith(f"1 of 1 nodes do not answer (127.0.0.1:{port}: ")
    again = _run("stop", "--dir", str(server_dir))
    assert again.exit_code == 0 and "no server was running" in again.stdout


def test_status_of_a_directory_never_used(tmp_path):
    result = _run("status", "--dir", str(tmp_path / "nothing"))
    assert result.exit_code == 1
    assert "no server was started" in result.stderr


def test_restart_with_same_dir_keeps_credentials_and_options(server_dir):
    port = free_port_block(1)
    first = _start_json("--dir", str(server_dir), "--port", str(port), "--maxmemory", "24MiB")
    passwords = Credentials.load(server_dir).passwords
    secret = open(first["secret_file"], "rb").read()
    assert _run("stop", "--dir", str(server_dir)).exit_code == 0
    second = _start_json("--dir", str(server_dir))  # port and maxmemory come from the last start
    assert second["writer_url"] == first["writer_url"] and second["reader_url"] == first["reader_url"]
    assert Credentials.load(server_dir).passwords == passwords
    assert open(second["secret_file"], "rb").read() == secret
    assert second["maxmemory"] == 24 * 1024**2
    tier = RemoteTier(second["writer_url"], secret=secret.strip(), namespace="n")
    assert tier.put("pgo", "k", b"v" * 100) and tier.get("pgo", "k").value == b"v" * 100


def test_aof_keeps_the_cache_across_a_restart(server_dir):
    info = _start_json("--dir", str(server_dir), "--port", str(free_port_block(1)), "--aof")
    secret = open(info["secret_file"], "rb").read().strip()
    assert RemoteTier(info["writer_url"], secret=secret, namespace="n").put("fx_graph", "k", b"kept" * 1000)
    assert _run("stop", "--dir", str(server_dir)).exit_code == 0
    info = _start_json("--dir", str(server_dir))
    assert RemoteTier(info["reader_url"], secret=secret, namespace="n").get("fx_graph", "k").value == b"kept" * 1000


def test_second_start_from_the_same_dir_is_refused(server_dir):
    _start_json("--dir", str(server_dir), "--port", str(free_port_block(1)))
    result = _run("start", "--dir", str(server_dir), "--port", str(free_port_block(1)))
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "is in use" in result.stderr and "warmstart server stop" in result.stderr


def test_metrics_endpoint_serves_prometheus_text(server_dir):
    port, metrics_port = free_port_block(1), free_port_block(1)
    info = _start_json("--dir", str(server_dir), "--port", str(port), "--metrics-port", str(metrics_port))
    assert info["metrics_url"] == f"http://127.0.0.1:{metrics_port}/metrics"
    secret = open(info["secret_file"], "rb").read().strip()
    tier = RemoteTier(info["writer_url"], secret=secret, namespace="metrics-ns")
    assert tier.put("fx_graph", "k", b"x" * 5000) and tier.get("fx_graph", "k").value
    with urllib.request.urlopen(info["metrics_url"], timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    node = f'{{node="127.0.0.1:{port}"}}'
    assert samples["warmstart_server_up" + node] == 1
    assert samples["warmstart_server_keys" + node] == 2  # small value: inline in its pointer; the index
    assert samples["warmstart_server_maxmemory_bytes" + node] == 1024**3
    assert samples["warmstart_server_keyspace_hits_total" + node] >= 1  # one round trip per read
    assert samples['warmstart_server_namespace_bytes{namespace="metrics-ns"}'] > 0
    assert samples["warmstart_server_cluster_ok"] == 1
    exporter = ServerState.load(server_dir).exporter_pid
    assert pid_alive(exporter)
    assert _run("stop", "--dir", str(server_dir)).exit_code == 0
    assert not pid_alive(exporter)


def test_foreground_runs_until_sigterm(server_dir):
    port = free_port_block(1)
    proc = _start_foreground(server_dir, port)
    try:
        printed = _read_json_object(proc.stdout)
        info = json.loads(printed)
        state = ServerState.load(server_dir)
        assert state.supervisor_pid == proc.pid and pid_alive(state.pids[0])
        creds = Credentials.load(server_dir)
        assert state.client(port, "writer", creds).set("ws:fg", b"1")
        assert "writer_url" not in info and all(p not in printed for p in creds.passwords.values())
        assert open(info["writer_url_file"]).read().strip() == state.url("writer", creds)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert not pid_alive(state.pids[0])
        assert ServerState.load(server_dir).running_pids() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_ends_a_foreground_server(server_dir):
    proc = _start_foreground(server_dir, free_port_block(1))
    try:
        _read_json_object(proc.stdout)
        node_pid = ServerState.load(server_dir).pids[0]
        result = _run("stop", "--dir", str(server_dir))
        assert result.exit_code == 0, result.output
        assert proc.wait(15) == 0
        assert not pid_alive(node_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start_foreground(server_dir, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "warmstart",
            "server",
            "start",
            "--foreground",
            "--json",
            "--dir",
            str(server_dir),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _read_json_object(stream) -> str:
    deadline = time.monotonic() + 30
    lines = []
    for line in stream:
        lines.append(line)
        if line.startswith("}"):
            return "".join(lines)
        assert time.monotonic() < deadline
    raise AssertionError("the foreground server printed no JSON: " + "".join(lines))


def test_rotate_writer_password_and_secret_on_a_running_server(server_dir):
    port = free_port_block(1)
    info = _start_json("--dir", str(server_dir), "--port", str(port))
    old = Credentials.load(server_dir)
    old_secret = open(info["secret_file"], "rb").read().strip()
    assert RemoteTier(info["writer_url"], secret=old_secret, namespace="n").put("fx_graph", "k", b"old" * 500)
    no_retry = dict(retry=Retry(NoBackoff(), 0))
    old_writer = redis.Redis(port=port, username="writer", password=old.passwords["writer"], **no_retry)
    reader_conn = redis.Redis(port=port, username="reader", password=old.passwords["reader"], **no_retry)
    assert old_writer.ping() and reader_conn.ping()

    result = _run("rotate", "--dir", str(server_dir), "--user", "writer", "--secret", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["nodes_reloaded"] == 1
    new = Credentials.load(server_dir)
    assert new.passwords["writer"] != old.passwords["writer"] and new.passwords["reader"] == old.passwords["reader"]
    new_secret = open(info["secret_file"], "rb").read().strip()
    assert new_secret != old_secret

    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, username="writer", password=old.passwords["writer"], **no_retry).ping()
    # ACL LOAD drops every connection; a client with the old password cannot come back.
    with pytest.raises((redis.ConnectionError, redis.AuthenticationError)):
        old_writer.ping()
    assert reader_conn.ping()  # the reader's password did not change: it still gets in
    writer_url = (server_dir / "writer.url").read_text().strip()
    assert new.passwords["writer"] in writer_url
    reader_url = (server_dir / "reader.url").read_text().strip()
    # The new secret starts a key space of its own: the old entry is a miss (never read, never
    # overwritten), a new write is a hit, and a job still on the old secret keeps its entry.
    reader = RemoteTier(reader_url, secret=new_secret, namespace="n")
    assert reader.get("fx_graph", "k").value is None
    assert reader.stats.to_dict()["remote"]["fx_graph"]["misses"] == 1
    assert RemoteTier(writer_url, secret=new_secret, namespace="n").put("fx_graph", "k", b"new" * 500)
    assert reader.get("fx_graph", "k").value == b"new" * 500
    assert RemoteTier(reader_url, secret=old_secret, namespace="n").get("fx_graph", "k").value == b"old" * 500


def test_rotate_needs_something_to_rotate(server_dir):
    result = _run("rotate", "--dir", str(server_dir))
    assert result.exit_code == 2 and "nothing to rotate" in result.stderr


def test_a_dir_others_can_write_is_made_private_with_one_warning(server_dir, caplog):
    server_dir.mkdir(mode=0o777)
    os.chmod(server_dir, 0o777)
    result = CliRunner().invoke(
        cli, ["server", "start", "--dir", str(server_dir), "--port", str(free_port_block(1)), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert os.stat(server_dir).st_mode & 0o777 == 0o700
    warned = [r.getMessage() for r in caplog.records if "made private (0700)" in r.getMessage()]
    assert len(warned) == 1 and "mode 777" in warned[0], warned


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="giving the key to another user (chown) needs root; the key others can write is refused in the next test",
)
def test_a_dir_holding_a_key_another_user_planted_is_refused(server_dir):
    """In a directory others could write, another user replaced the signing key: adopting it would
    let that user sign entries every job accepts."""
    from warmstart.compile_cache.signing import generate_key_pair

    server_dir.mkdir(mode=0o700)
    generate_key_pair(server_dir / "signing.key", server_dir / "verify.pub")
    os.chown(server_dir / "signing.key", 65534, 65534)  # nobody
    result = CliRunner().invoke(cli, ["server", "start", "--dir", str(server_dir), "--port", str(free_port_block(1))])
    assert result.exit_code == 2, result.output
    assert "holds signing.key, which another user owns or can write" in result.output
    assert not (server_dir / "state.json").exists()  # nothing was started


def test_a_dir_holding_a_key_others_can_write_is_refused(server_dir):
    """The same refusal for any user: a key that others could have replaced is never adopted."""
    from warmstart.compile_cache.signing import generate_key_pair

    server_dir.mkdir(mode=0o700)
    generate_key_pair(server_dir / "signing.key", server_dir / "verify.pub")
    os.chmod(server_dir / "signing.key", 0o666)
    result = CliRunner().invoke(cli, ["server", "start", "--dir", str(server_dir), "--port", str(free_port_block(1))])
    assert result.exit_code == 2, result.output
    assert "holds signing.key, which another user owns or can write" in result.output
    assert not (server_dir / "state.json").exists()  # nothing was started


def test_the_export_lines_start_prints_turn_warmstart_on(server_dir):
    """A job run with exactly the settings ``server start`` prints uses the cache: the lines
    include ``WARMSTART=1``, and the writer's reach the server with its key."""
    result = _run("start", "--dir", str(server_dir), "--port", str(free_port_block(1)))
    assert result.exit_code == 0, result.output
    exports = [line.strip() for line in result.output.splitlines() if line.strip().startswith("export ")]
    assert len(exports) == 2, result.output
    probe = (
        "from warmstart.config import Settings; s = Settings.from_env(); "
        "print(s.enabled, s.cache_url.startswith('redis://'), s.key_file)"
    )
    for line, key in zip(exports, ("signing.key", "verify.pub"), strict=True):
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
        done = subprocess.run(
            ["bash", "-c", f'{line}; exec "$0" -c "$1"', sys.executable, probe],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["True", "True", str(server_dir / key)], (line, done.stdout)
