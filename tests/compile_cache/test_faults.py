"""Fault injection against real redis-server processes, real sockets and real torch.compile jobs:
every fault costs a job one failed operation, ended by its deadline (counted: one timeout or error,
then the breaker keeps the rest off the network), and never an exception. Time appears here only
as hang guards (``pytest.mark.timeout``), never as a speed check: the figures are in benchmarks."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import redis
from _redis import RedisNode, free_port_block
from _wait import until

from warmstart import _defaults
from warmstart.compile_cache import RemoteTier, TieredStore, get_store, open_store, signing
from warmstart.compile_cache.storage import BREAKER_OPEN, ERROR, TIMEOUT
from warmstart.config import Settings

SECRET = b"fault-secret"
#: Hang guard for a test whose faults each cost one deadline (a few seconds): not a speed check.
HANG_GUARD_S = 120


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# -- 1. opening the store ------------------------------------------------------------------------


@contextlib.contextmanager
def _immutable(path: Path):
    """``path`` made unwritable even for root (``chattr +i``); plain permissions otherwise."""
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield
        finally:
            path.chmod(0o700)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root, and chattr +i is not available to make a directory unwritable")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@contextlib.contextmanager
def bad_cache_dir(fault: str, base: Path):
    """A cache directory with ``fault``: a corrupt database, a file in its place, or unwritable."""
    path = base / f"cache-{fault}"
    if fault == "corrupt_db":
        (path / "store").mkdir(parents=True, mode=0o700)
        (path / "store" / "cache.db").write_bytes(b"this is not a SQLite database\n" * 200)
        yield path
    elif fault == "file":
        path.write_text("a file where the cache directory should be\n")
        yield path
    else:
        path.mkdir(mode=0o700)
        with _immutable(path):
            yield path


LOCAL_FAULTS = ["corrupt_db", "file", "unwritable"]


@pytest.mark.parametrize("fault", LOCAL_FAULTS)
def test_unusable_cache_dir_turns_the_local_tier_off_with_one_warning(
    fault, redis_node, fresh_machine, tmp_path, monkeypatch, caplog
):
    with bad_cache_dir(fault, tmp_path) as cache_dir:
        monkeypatch.setenv("WARMSTART", "1")
        monkeypatch.setenv("WARMSTART_CACHE_DIR", str(cache_dir))
        assert get_store() is None  # local only, and that is off: no store, no exception
        # With a remote tier the store is remote-only, and works.
        env = {
            "WARMSTART": "1",
            "WARMSTART_CACHE_DIR": str(cache_dir),
            "WARMSTART_CACHE_URL": redis_node.url,
            "WARMSTART_SECRET": SECRET.decode(),
        }
        for _ in range(3):
            store = open_store(Settings.from_env(env), persist_stats=False)
            assert store.local is None and store.remote is not None
        store.put("fx_graph", "k", b"graph" * 1000, sync=True)
        assert store.get("fx_graph", "k").value == b"graph" * 1000
        store.close()
    lines = _warnings(caplog, "local cache tier off")
    assert len(lines) == 1, lines  # once per process per cause
    assert "\n" not in lines[0] and str(cache_dir) in lines[0]


def test_a_database_damaged_while_in_use_turns_the_local_tier_off(tmp_path, caplog):
    store = open_store(
        Settings.from_env({"WARMSTART": "1", "WARMSTART_CACHE_DIR": str(tmp_path / "c")}), persist_stats=False
    )
    store.put("fx_graph", "k", b"v" * 100)
    store.local._cache.close()
    (tmp_path / "c" / "store" / "cache.db").write_bytes(b"garbage" * 1000)
    results = []
    for i in range(5):
        results.append(store.get("fx_graph", f"k{i}"))
        assert results[-1].value is None
        store.put("fx_graph", f"k{i}", b"v")
    assert store.local._off
    # The lookup that found the damage is an error; the tier is off for the rest.
    assert [r.reason for r in results] == [ERROR] + [BREAKER_OPEN] * 4
    assert len(_warnings(caplog, "local cache tier off")) == 1


def test_bad_url_option_turns_the_cache_off_with_one_line_never_raises(fresh_machine, tmp_path, monkeypatch, caplog):
    url = "redis://writer:hunter2@127.0.0.1:1/0?socket_timeout=abc"
    monkeypatch.setenv("WARMSTART", "1")
    monkeypatch.setenv("WARMSTART_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("WARMSTART_CACHE_URL", url)
    monkeypatch.setenv("WARMSTART_SECRET", "s")
    assert get_store() is None
    lines = _warnings(caplog, "compile cache off")
    assert len(lines) == 1 and "socket_timeout" in lines[0] and "abc" in lines[0] and "hunter2" not in lines[0]
    # Settings built without the environment's checks: connect() refuses the option inside
    # open_store, and the store is local-only.
    settings = Settings(enabled=True, cache_url=url, cache_dir=tmp_path / "d", secret=b"s")
    store = open_store(settings, persist_stats=False)
    assert store is not None and store.local is not None and store.remote is None
    lines = _warnings(caplog, "remote cache tier off")
    assert len(lines) == 1 and "hunter2" not in lines[0] and "writer:***@" in lines[0]


# Real compile jobs: torch's C++ build hook, ISA-probe hook and remote-cache backends all call
# get_store(); the job must finish with the right loss. The first compiles cold (every hook runs);
# the second reuses its torch caches. The other local faults take the same path as a corrupt database
# (tested in-process above).
JOB_FAULTS = ["corrupt_db", "bad_url_option"]


def _eager_tiny_loss() -> float:
    import torch

    torch.manual_seed(0)  # as benchmarks/compile_job.py builds its "tiny" model and input
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)
    with torch.no_grad():
        return float(torch.relu(lin(x)).sum(1, keepdim=True).float().pow(2).mean())


@pytest.mark.slow
def test_compile_jobs_finish_through_every_store_fault(tmp_path):
    from test_torch_integration import run_job

    expected = _eager_tiny_loss()
    machine = tmp_path / "machine"
    for fault in JOB_FAULTS:
        if fault == "bad_url_option":
            env = {"WARMSTART_CACHE_URL": "redis://u:hunter2@127.0.0.1:1/0?socket_timeout=abc"}
            result, stderr = run_job(machine, "tiny", extra_env=env)
            assert stderr.count("disabled in this process") == 1 and "hunter2" not in stderr
        else:
            with bad_cache_dir(fault, tmp_path) as cache_dir:
                result, stderr = run_job(
                    machine, "tiny", secret=None, extra_env={"WARMSTART_CACHE_DIR": str(cache_dir)}
                )
            assert stderr.count("local cache tier off") == 1, stderr[-2000:]
        assert result["losses"]["tiny"] == pytest.approx(expected, rel=1e-5), fault
        assert "Traceback" not in stderr, stderr[-3000:]


# -- 2. a deadline for the whole operation -------------------------------------------------------


class DripServer:
    """A TCP server on 127.0.0.1 that answers each request with a valid-looking RESP reply, one
    byte every ``interval`` seconds: every socket read gets a byte before it would time out."""

    def __init__(self, reply: bytes = b"$10\r\nwarmstart!\r\n", interval: float = 1.5) -> None:
        self.reply, self.interval = reply, interval
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.1)
            while not self._stop.is_set():
                try:
                    if not conn.recv(1 << 16):
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return
                for byte in self.reply:
                    if self._stop.wait(self.interval):
                        return
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        return

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


@pytest.fixture
def drip_server():
    server = DripServer()
    yield server
    server.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_server_dripping_bytes_costs_one_deadline_then_the_breaker_opens(drip_server):
    tier = RemoteTier(drip_server.url, secret=SECRET, namespace="drip")
    results = [tier.get("fx_graph", f"k{i}") for i in range(21)]
    assert all(r.value is None for r in results)
    assert not tier.breaker.allow()
    # The first lookup ended at its deadline (a timeout, though every read got a byte in time);
    # the breaker then kept the other 20 off the network: none of them timed out.
    counts = tier.stats.get("remote", "fx_graph")
    assert (counts.timeouts, counts.errors, counts.misses, counts.hits) == (1, 0, 21, 0)
    assert [r.reason for r in results] == [TIMEOUT] + [BREAKER_OPEN] * 20


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_write_to_a_dripping_server_costs_one_deadline(drip_server):
    tier = RemoteTier(drip_server.url, secret=SECRET, namespace="drip")
    value = os.urandom(2 * 1024 * 1024)
    assert tier.put("cpp_object", "k", value) is False
    assert not tier.breaker.allow()
    counts = tier.stats.get("remote", "cpp_object")
    assert (counts.timeouts, counts.errors, counts.writes) == (1, 0, 0)  # ended at its deadline


# -- 3. a dead Redis Cluster ---------------------------------------------------------------------


def _look_up(tier: RemoteTier, n: int = 21):
    """``n`` lookups, every one a miss; the tier's counts for them, after checking that the first
    reached the server and failed as the counts say (a timeout or an error), and the breaker kept
    the rest off it."""
    results = [tier.get("fx_graph", f"k{i}") for i in range(n)]
    assert all(r.value is None for r in results)
    counts = tier.stats.get("remote", "fx_graph")
    first = TIMEOUT if counts.timeouts else ERROR
    assert [r.reason for r in results] == [first] + [BREAKER_OPEN] * (n - 1), [r.reason for r in results]
    return counts


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_cluster_node_that_never_answers_costs_one_timeout_then_the_breaker_opens():
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:  # accepts TCP, never replies
        tier = RemoteTier(f"redis+cluster://127.0.0.1:{listener.getsockname()[1]}", secret=SECRET, namespace="cl")
        counts = _look_up(tier)
    assert not tier.breaker.allow()
    assert counts.misses == 21
    assert counts.timeouts + counts.errors == 1  # only the first lookup reached the network


@pytest.fixture
def lone_cluster_node(tmp_path_factory):
    """A one-master Redis Cluster (all slots on one real node), for stopping it."""
    node = RedisNode(tmp_path_factory.mktemp("lone"), port=free_port_block(1, bus=True))
    node.extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
    node.start()
    client = redis.Redis(port=node.port)
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    until(lambda: client.cluster("info").get("cluster_state") == "ok", timeout=10, poll_s=0.05)
    client.close()
    yield node
    if node.proc.poll() is None:
        os.kill(node.proc.pid, signal.SIGCONT)
    node.stop()


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_cluster_node_costs_one_timeout_then_the_breaker_opens(lone_cluster_node, how):
    tier = RemoteTier(f"redis+cluster://127.0.0.1:{lone_cluster_node.port}", secret=SECRET, namespace="cl")
    assert tier.put("fx_graph", "warm", b"v" * 100) and tier.get("fx_graph", "warm").value == b"v" * 100
    if how == "SIGSTOP":
        os.kill(lone_cluster_node.proc.pid, signal.SIGSTOP)  # alive, accepting TCP, answering nothing
    else:
        lone_cluster_node.kill()
    counts = _look_up(tier)
    assert not tier.breaker.allow()
    assert counts.misses == 21
    assert counts.timeouts + counts.errors == 1  # only the first lookup reached the network


# -- 4. the background write queue ---------------------------------------------------------------


@pytest.mark.timeout(HANG_GUARD_S)
def test_queued_writes_are_bounded_in_bytes_and_exit_waits_a_bounded_time(redis_node, caplog):
    # A writer stuck for longer than the exit bound (long socket timeout and deadline): close(),
    # which atexit runs, must not wait it out.
    tier = RemoteTier(f"{redis_node.url}?socket_timeout=60", secret=SECRET, namespace="q")
    tier.op_deadline_s = 60.0
    store = TieredStore(None, tier)
    value = os.urandom(16 * 1024 * 1024)  # one object queued 40 times: the count is what is tested
    os.kill(redis_node.proc.pid, signal.SIGSTOP)
    try:
        most = 0
        for i in range(40):
            store.put("cpp_object", f"k{i}", value)
            most = max(most, store.queued_bytes)
        assert most <= _defaults.WRITE_QUEUE_BYTES == store.queue_bytes
        assert store.stats.get("remote", "cpp_object").dropped >= 40 - _defaults.WRITE_QUEUE_BYTES // len(value)
        store.close()  # what atexit runs
        assert store.queued_bytes <= len(value)  # the rest were dropped at close, not kept in memory
    finally:
        os.kill(redis_node.proc.pid, signal.SIGCONT)
    # close() waited for its bound (not for the stuck writer's 60 s), then gave up and dropped the rest.
    assert len(_warnings(caplog, "gave up waiting for remote cache writes at exit")) == 1


def test_a_stalled_server_drains_the_queue_in_one_deadline(redis_node):
    tier = RemoteTier(redis_node.url, secret=SECRET, namespace="q")
    store = TieredStore(None, tier)
    value = os.urandom(4 * 1024 * 1024)
    os.kill(redis_node.proc.pid, signal.SIGSTOP)
    try:
        for i in range(20):
            store.put("cpp_object", f"k{i}", value)
        assert store.flush(timeout=30)  # hang guard, not a speed check
    finally:
        os.kill(redis_node.proc.pid, signal.SIGCONT)
    # The first write times out at its deadline and opens the breaker; the rest are dropped at once.
    counts = tier.stats.get("remote", "cpp_object")
    assert (counts.timeouts, counts.dropped, counts.writes) == (1, 19, 0)
    assert store.queued_bytes == 0 and not tier.breaker.allow()
    store.close()


# -- 5. compressors per thread -------------------------------------------------------------------

_THREADS_SCRIPT = textwrap.dedent("""
    import sys, threading
    from warmstart.compile_cache import RemoteTier

    tier = RemoteTier(sys.argv[1], secret=b"s", namespace="threads", chunk_bytes=256 * 1024)
    bad = []

    def work(t):
        for j in range(12):
            value = (f"thread {t} value {j}: def forward(self, x): return x * {j}\\n".encode() * (4000 + 500 * t))
            if not tier.put("fx_graph", f"{t}:{j}", value) or tier.get("fx_graph", f"{t}:{j}").value != value:
                bad.append((t, j))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("BAD", len(bad), tier.stats.get("remote", "fx_graph"))
""")


def test_many_threads_share_one_remote_tier(redis_node):
    # In a child process: a compressor shared across threads crashes the interpreter.
    proc = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT, redis_node.url], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "BAD 0 " in proc.stdout, proc.stdout


# -- 7. chunks at predictable keys ---------------------------------------------------------------


def test_planted_chunks_are_repaired_and_oversize_ones_never_fetched(redis_node):
    writer = RemoteTier(redis_node.url, secret=SECRET, namespace="pl", chunk_bytes=64 * 1024)
    payload = os.urandom(300 * 1024)  # incompressible: stored as is, in 5 chunks
    keys = writer._chunk_keys(signing.blob_digest(payload), 5)
    client = redis.Redis.from_url(redis_node.url)
    # Planted before the real write by someone without the secret: garbage of the right length,
    # an oversize value, a short one.
    client.set(keys[0], os.urandom(64 * 1024))
    client.set(keys[1], b"x" * (16 * 1024 * 1024))
    client.set(keys[4], b"short")
    assert writer.put("cpp_object", "so", payload)
    reader = RemoteTier(redis_node.url, secret=SECRET, namespace="pl")  # another chunk size: the pointer decides
    assert reader.get("cpp_object", "so").value == payload
    assert client.strlen(keys[1]) == 64 * 1024

    # Planted after the write: rejected from its length alone, its bytes never fetched or joined.
    client.set(keys[2], b"y" * (32 * 1024 * 1024))
    sent_before = client.info("stats")["total_net_output_bytes"]
    assert reader.get("cpp_object", "so").value is None
    sent = client.info("stats")["total_net_output_bytes"] - sent_before
    assert sent < 2 * len(payload) + 64 * 1024, sent
    counts = reader.stats.get("remote", "cpp_object")
    assert (counts.rejected, counts.hits) == (1, 1)
    # The next write (the job compiled it again) repairs the entry.
    assert writer.put("cpp_object", "so", payload)
    assert reader.get("cpp_object", "so").value == payload


def test_a_pointer_to_damaged_chunks_is_replaced_by_the_next_write(redis_node):
    writer = RemoteTier(redis_node.url, secret=SECRET, namespace="pl2", chunk_bytes=64 * 1024)
    old, new = os.urandom(200 * 1024), os.urandom(200 * 1024)  # another build of the same key
    assert writer.put("cpp_object", "so", old)
    client = redis.Redis.from_url(redis_node.url)
    old_keys = writer._chunk_keys(signing.blob_digest(old), 4)
    client.set(old_keys[1], os.urandom(64 * 1024))  # right length, wrong bytes
    reader = RemoteTier(redis_node.url, secret=SECRET, namespace="pl2")
    assert reader.get("cpp_object", "so").value is None
    assert writer.put("cpp_object", "so", new)
    assert reader.get("cpp_object", "so").value == new
