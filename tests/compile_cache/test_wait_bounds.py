"""What the cache can cost a job, in total: leases a waiter can verify, host locks that lapse when
their holder stops, slow tiers treated as faults, one time budget per process, bounded pointer reads,
and fork safety. Real redis-server processes, real SQLite locks, real stopped processes.

Times appear only as hang guards far above a healthy run; each test checks what the fault was
allowed to reach (requests that got to the server, waits that started, tiers left on)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis

from warmstart.compile_cache import open_store, signing
from warmstart.compile_cache.local import LocalTier
from warmstart.compile_cache.remote import RemoteTier
from warmstart.compile_cache.storage import ABSENT, BREAKER_OPEN, TIMEOUT
from warmstart.config import Settings

SECRET = b"bounds-secret"
HANG_GUARD_S = 120

pytestmark = pytest.mark.timeout(HANG_GUARD_S)


def _store(cache_dir: Path, url: str | None = None, **extra: str):
    env = {"WARMSTART": "1", "WARMSTART_CACHE_DIR": str(cache_dir)}
    if url:
        env.update(WARMSTART_CACHE_URL=url, WARMSTART_SECRET=SECRET.decode())
    env.update(extra)
    return open_store(Settings.from_env(env), persist_stats=False)


# -- leases a waiter can verify ---------------------------------------------------------------------


def test_a_planted_lease_is_ignored_and_costs_no_wait(redis_node, tmp_path):
    """With the writer's password but no signing key, anyone can SET a key under a lease's name, with
    no expiry. A job honours only leases its own key verifies: it compiles at once."""
    store = _store(tmp_path / "job", redis_node.url, WARMSTART_COMPILE_WAIT_S="30")
    tier = store.remote
    client = redis.Redis.from_url(redis_node.url)
    keys = [f"planted-{i}" for i in range(20)]
    for key in keys:
        client.set(tier.leases._lease_key("fx_graph", key), b"someone else's lease")  # never expires
    try:
        start = time.monotonic()
        for key in keys:
            assert store.get("fx_graph", key).value is None
        assert time.monotonic() - start < HANG_GUARD_S / 4  # each would have waited 30 s
        counters = store.stats.counters_dict()
        assert counters.get("waits", 0) == 0 and counters.get("leases_ignored", 0) >= len(keys), counters
    finally:
        store.close()


def test_a_lease_signed_for_another_entry_or_expired_is_not_honoured(redis_node):
    tier = RemoteTier(redis_node.url, secret=SECRET, namespace="leases")
    other = RemoteTier(redis_node.url, secret=b"another team's secret", namespace="leases")
    name = tier.leases._lease_key("fx_graph", "k")
    client = redis.Redis.from_url(redis_node.url)
    # a lease another entry's holder signed, copied here
    client.set(name, tier.keys.sign_lease(signing.LeaseRecord("leases", "fx_graph", "other", "t", 2**62)))
    assert tier.leases.held("fx_graph", "k") is False
    # signed for this entry, but expired (a replayed record, its Redis expiry stripped)
    client.set(name, tier.keys.sign_lease(signing.LeaseRecord("leases", "fx_graph", "k", "t", 1000)))
    assert tier.leases.held("fx_graph", "k") is False
    # a valid one is honoured; another secret's job does not see it as its own
    assert client.delete(name) and tier.leases.take("fx_graph", "k", "mine", 5.0) is True
    assert tier.leases.held("fx_graph", "k") is True
    assert other.leases.held("fx_graph", "k") is False


def test_a_renewal_never_takes_a_lease_another_process_took(redis_node):
    """A holder stalled past its lease's lapse; another process took the lease. The stalled holder's
    renewal and release must leave the new holder's lease alone."""
    stalled = RemoteTier(redis_node.url, secret=SECRET, namespace="race")
    taker = RemoteTier(redis_node.url, secret=SECRET, namespace="race")
    assert stalled.leases.take("fx_graph", "k", "stalled", 0.2) is True
    time.sleep(0.4)  # lapsed
    assert taker.leases.take("fx_graph", "k", "taker", 30.0) is True
    assert stalled.leases.renew([("fx_graph", "k", "stalled")], 30.0) == [("fx_graph", "k")]
    stalled.leases.drop("fx_graph", "k", "stalled")
    record = redis.Redis.from_url(redis_node.url).get(taker.leases._lease_key("fx_graph", "k"))
    lease = taker.keys.verify_lease(record, namespace="race", kind="fx_graph", key="k")
    assert lease.token == "taker"
    # the holder's own renewal goes through
    assert taker.leases.renew([("fx_graph", "k", "taker")], 30.0) == []


# -- host locks that lapse -------------------------------------------------------------------------------

_HOLDER = textwrap.dedent("""
    import sys, time
    from warmstart.compile_cache import open_store
    from warmstart.config import Settings
    store = open_store(Settings.from_env({"WARMSTART": "1", "WARMSTART_CACHE_DIR": sys.argv[1]}), persist_stats=False)
    with store.single_flight.scope():
        for i in range(int(sys.argv[2])):
            assert store.get("fx_graph", f"entry-{i}").value is None  # a miss: this process holds the lease
        print("held", flush=True)
        time.sleep(600)
""")


def test_a_stopped_holder_on_the_same_host_is_taken_over_after_the_lease_time(tmp_path):
    """A scheduler's suspend, a debugger or a core dump under way stops a holder that keeps its host
    locks (flock has no lapse of its own). Waiters take them over once the holder stops touching them."""
    cache = tmp_path / "host-cache"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(cache), "5"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        waiter = _store(cache, WARMSTART_COMPILE_WAIT_S="60")
        start = time.monotonic()
        for i in range(5):
            assert waiter.get("fx_graph", f"entry-{i}").value is None
        elapsed = time.monotonic() - start
        counters = waiter.stats.counters_dict()
        assert counters.get("stale_locks", 0) == 5 and counters.get("wait_timeouts", 0) == 0, counters
        assert elapsed < 30, elapsed  # five waits of 60 s before; the lease time (3 s) once now
        waiter.close()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


def test_lock_files_are_removed_when_released(tmp_path):
    store = _store(tmp_path / "cache")
    for i in range(30):
        with store.single_flight.scope():
            assert store.get("fx_graph", f"k{i}").value is None
            store.put("fx_graph", f"k{i}", b"value")
    assert list((tmp_path / "cache" / "leases").glob("*.lock")) == []
    store.close()


# -- slow is a fault ---------------------------------------------------------------------------------


class SlowProxy:
    """A TCP proxy in front of a real redis-server that holds each reply to a data command (GET,
    GETRANGE, SET, EXISTS...) for ``delay_s`` before passing it on; connection set-up passes at once."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.delayed = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:  # the server behind went away: so does this client, as it would without us
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        with client, server:
            while not self._closed:
                try:
                    request = client.recv(1 << 20)
                    if not request:
                        return
                    server.sendall(request)
                    reply = server.recv(1 << 20)
                except OSError:
                    return
                command = request.split(b"\r\n")[2].upper() if request.startswith(b"*") else b""
                if command not in (b"HELLO", b"AUTH", b"CLIENT", b"PING", b"SELECT"):
                    self.delayed += 1
                    time.sleep(self.delay_s)
                try:
                    client.sendall(reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def test_a_server_answering_each_reply_after_most_of_its_deadline_is_turned_off(redis_node):
    proxy = SlowProxy(redis_node.port, 0.9)  # the deadline is 2 s: no operation ever times out
    try:
        tier = RemoteTier(f"redis://127.0.0.1:{proxy.port}/0", secret=SECRET, namespace="slow")
        results = [tier.get("fx_graph", f"k{i}") for i in range(10)]
        assert all(r.value is None for r in results)
        # Three answered (slowly: there is nothing there), then the breaker kept the rest off the server.
        assert [r.reason for r in results] == [ABSENT] * 3 + [BREAKER_OPEN] * 7
        assert not tier.breaker.allow()
        assert tier.stats.counters_dict().get("slow_trips") == 1
        assert proxy.delayed == 3  # three slow replies in a row, then the other seven never left the job
        counts = tier.stats.get("remote", "fx_graph")
        assert (counts.misses, counts.timeouts, counts.errors) == (10, 0, 0)
    finally:
        proxy.close()


_LOCKER = textwrap.dedent("""
    import sqlite3, sys, time
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    time.sleep(600)
""")


def test_a_local_tier_locked_by_a_stopped_process_goes_off_for_the_process(tmp_path, caplog):
    tier = LocalTier(tmp_path / "cache", 1 << 30)
    tier.put("fx_graph", "k", b"value")
    locker = subprocess.Popen(
        [sys.executable, "-c", _LOCKER, str(tmp_path / "cache" / "store" / "cache.db")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert locker.stdout.readline().strip() == "locked"
        os.kill(locker.pid, signal.SIGSTOP)
        start = time.monotonic()
        results = [tier.get("fx_graph", "k") for _ in range(10)]
        elapsed = time.monotonic() - start
        assert all(not r for r in results)
        # The first waited out the lock; the tier was off for the other nine.
        assert [r.reason for r in results] == [TIMEOUT] + [BREAKER_OPEN] * 9
        assert tier.put("fx_graph", "k2", b"value") is False  # off: refused at once
        assert elapsed < 10, elapsed  # 10 reads waited 2 s each before: one lock timeout now
        warned = [r.getMessage() for r in caplog.records if "stayed locked" in r.getMessage()]
        assert len(warned) == 1, warned
    finally:
        os.kill(locker.pid, signal.SIGKILL)
        locker.wait()
        tier.close()


# -- one budget per process ---------------------------------------------------------------------------


def test_one_budget_bounds_every_wait_of_the_process_together(redis_node, tmp_path, caplog):
    """Another process holds leases on 10 entries and never finishes: each wait alone is bounded by
    WARMSTART_COMPILE_WAIT_S, and all of them together by WARMSTART_MAX_WAIT_S."""
    holder = _store(tmp_path / "holder", redis_node.url)
    held = threading.Event()
    done = threading.Event()

    def hold():
        with holder.single_flight.scope():
            for i in range(10):
                holder.get("fx_graph", f"e{i}")
            held.set()
            done.wait(HANG_GUARD_S)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(30)
    waiter = _store(tmp_path / "waiter", redis_node.url, WARMSTART_COMPILE_WAIT_S="1.0", WARMSTART_MAX_WAIT_S="2.5")
    try:
        results = [waiter.get("fx_graph", f"e{i}") for i in range(10)]
        assert all(r.value is None for r in results)
        # Once the budget is spent the remote tier is not asked: a timeout, not an absent entry.
        assert results[-1].reason is TIMEOUT and results[-1].tier == "remote", results[-1]
        assert "time for waiting on the cache is spent" in results[-1].detail
        counters = waiter.stats.counters_dict()
        assert 2 <= counters["waits"] <= 3, counters  # 1 s, 1 s, then what was left: 0.5 s
        assert waiter.budget.exhausted and waiter.budget.spent_s < 4.0, waiter.budget.spent_s
        assert len([r for r in caplog.records if "WARMSTART_MAX_WAIT_S" in r.getMessage()]) == 1
    finally:
        done.set()
        thread.join()
        waiter.close()
        holder.close()


# -- pointer records are bounded ------------------------------------------------------------------------


def test_a_planted_oversize_pointer_costs_its_first_bytes_and_a_writer_repairs_it(redis_node):
    tier = RemoteTier(redis_node.url, secret=SECRET, namespace="big")
    name = tier._pointer_key("fx_graph", "k")
    redis.Redis.from_url(redis_node.url).set(name, b"x" * (20 * 1024 * 1024))
    for _ in range(5):
        result = tier.get("fx_graph", "k")
        assert result.value is None and result.reason == "rejected", result
    assert tier.stats.get("remote", "fx_graph").bytes_read == 0
    assert tier.breaker.allow()
    assert tier.put("fx_graph", "k", b"the real entry")
    assert tier.get("fx_graph", "k").value == b"the real entry"


# -- fork safety ------------------------------------------------------------------------------------------

_FORKED = textwrap.dedent("""
    import os, sys, time
    from warmstart.compile_cache.remote import RemoteTier
    tier = RemoteTier(sys.argv[1], secret=b"bounds-secret", namespace="fork")
    tier.breaker._cooldown_s = 0.2
    tier.breaker.trip("test: the server failed")
    tier.breaker._probe = lambda: (_ for _ in ()).throw(OSError("still down"))  # the parent's probe keeps failing
    pid = os.fork()
    if pid == 0:
        tier.breaker._probe = tier._probe  # in the child the server answers
        end = time.monotonic() + 20
        while not tier.breaker.allow() and time.monotonic() < end:
            time.sleep(0.05)
        tier.stats.bump("after_fork")  # the counters' lock works in the child
        os._exit(0 if tier.breaker.allow() else 1)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
""")


def test_a_child_forked_while_the_breaker_is_open_probes_again(redis_node):
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED, redis_node.url], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "child 0" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
