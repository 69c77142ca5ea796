"""Single-flight compiles against real redis-server processes and real processes: a miss of an entry
another process is producing waits for it; a holder that dies, raises or stalls, a server that stops,
a read-only job and reader credentials each end the wait within a bound, never with an exception.

Each "machine" is a store with its own local directory; two stores on one directory are two ranks of
one host. Times appear only as hang guards (``pytest.mark.timeout``); speed is in the benchmarks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis
from _redis import RedisNode
from _wait import until

from warmstart import _defaults
from warmstart.compile_cache import open_store
from warmstart.compile_cache.storage import Hit, Miss
from warmstart.config import Settings

KIND, KEY, VALUE = "fx_graph", "fgraph-key-1", b"compiled graph" * 1000
#: Hang guard: every case here ends within a lease lifetime, a server deadline or a set wait bound.
HANG_GUARD_S = 60


def _events(store) -> dict:
    """The store's counters less its round trips to the server (counted on every connection)."""
    return {k: v for k, v in store.stats.counters_dict().items() if not k.startswith("round_trips")}


def _env(cache_dir: Path, url: str | None = None, **extra: str) -> dict[str, str]:
    env = {"WARMSTART": "1", "WARMSTART_CACHE_DIR": str(cache_dir)}
    if url:
        env.update(WARMSTART_CACHE_URL=url, WARMSTART_SECRET="flight-secret")
    env.update(extra)
    return env


def _store(cache_dir: Path, url: str | None = None, **extra: str):
    return open_store(Settings.from_env(_env(cache_dir, url, **extra)), persist_stats=False)


class _Lookup(threading.Thread):
    """``store.get`` in a thread, as the second process's compile would call it."""

    def __init__(self, store, kind: str = KIND, key: str = KEY) -> None:
        super().__init__(daemon=True)
        self.store, self.kind, self.key = store, kind, key
        self.result: Hit | Miss | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.store.get(self.kind, self.key)
        except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
            self.error = exc

    def waiting(self) -> bool:
        """Whether the lookup is (still) waiting on a lease."""
        return self.is_alive() and self.store.stats.counters_dict().get("waits", 0) >= 1

    def outcome(self, timeout: float = HANG_GUARD_S):
        self.join(timeout)
        assert not self.is_alive(), "the lookup did not end"
        assert self.error is None, self.error
        return self.result


def _lease_keys(url: str) -> list[bytes]:
    return [k for k in redis.Redis.from_url(url).scan_iter(match="ws:*:l:*")]


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_second_machine_waits_for_the_first_and_reads_its_entry(redis_node, tmp_path):
    a, b = _store(tmp_path / "a", redis_node.url), _store(tmp_path / "b", redis_node.url)
    assert not a.get(KIND, KEY)  # A misses and takes the lease: it compiles
    assert len(_lease_keys(redis_node.url)) == 1
    waiter = _Lookup(b)
    until(waiter.waiting)
    assert a.put(KIND, KEY, VALUE)  # the lease goes once the remote write is done
    result = waiter.outcome()
    assert result and result.value == VALUE and result.tier == "remote"
    assert _events(a) == {"leases": 1}
    counters = b.stats.counters_dict()
    assert counters["waits"] == 1 and "takeovers" not in counters and "leases" not in counters
    assert counters["wait_s"] > 0
    until(lambda: not _lease_keys(redis_node.url))
    a.close(), b.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_ranks_of_one_host_wait_on_the_local_lock_without_a_server(tmp_path):
    a, b = _store(tmp_path / "host"), _store(tmp_path / "host")
    assert not a.get(KIND, KEY)
    assert (tmp_path / "host" / "leases").is_dir()
    waiter = _Lookup(b)
    until(waiter.waiting)
    assert a.put(KIND, KEY, VALUE)
    result = waiter.outcome()
    assert result and result.value == VALUE and result.tier == "local"
    a.close(), b.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_compile_that_raises_releases_the_lease_and_a_waiter_takes_over(redis_node, tmp_path):
    a, b = _store(tmp_path / "a", redis_node.url), _store(tmp_path / "b", redis_node.url)
    waiter = None
    with pytest.raises(RuntimeError, match="g\\+\\+ failed"), a.single_flight.scope():  # what a frame's compile is
        assert not a.get(KIND, KEY)
        waiter = _Lookup(b)
        until(waiter.waiting)
        raise RuntimeError("g++ failed")
    result = waiter.outcome()
    assert not result and result.reason == "absent"
    assert b.stats.counters_dict()["takeovers"] == 1 and b.single_flight.held == 1  # B compiles now
    assert a.single_flight.held == 0
    a.close(), b.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_compile_that_stores_nothing_releases_the_lease_when_it_returns(redis_node, tmp_path):
    a, b = _store(tmp_path / "a", redis_node.url), _store(tmp_path / "b", redis_node.url)
    with a.single_flight.scope():
        assert not a.get(KIND, KEY)  # e.g. torch decided the graph is not cacheable
    assert a.single_flight.held == 0 and not _lease_keys(redis_node.url)
    assert not b.get(KIND, KEY) and _events(b) == {"leases": 1}  # no wait at all
    a.close(), b.close()


#: An AOTAutograd entry's key as torch's remote cache names it; torch saves it at the first backward.
AOT_KIND, AOT_KEY = "aot_autograd", "pt2:autograd-experimental::aot-key-1:c1"


def _backward_of_aot_key(key: str) -> bool:
    return "::aot-key-1:" in key


@pytest.fixture
def short_deferral(monkeypatch):
    """A deferred lease kept for 0.1 s after the last compile, so that a renewal (every second)
    would let it go in any pause longer than that."""
    from warmstart.compile_cache import single_flight

    monkeypatch.setattr(single_flight, "DEFERRED_MIN_S", 0.1)
    return 2 * _defaults.LEASE_TTL_S / 3 + 0.5  # two renewals and a margin


def _gate_remote_writes(store) -> threading.Event:
    """Hold ``store``'s background writes to its remote tier until the returned event is set (a
    slow upload); the real write happens then."""
    gate, put = threading.Event(), store.remote.put

    def held_put(*args, **kwargs):
        assert gate.wait(HANG_GUARD_S)
        return put(*args, **kwargs)

    store.remote.put = held_put
    return gate


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_lease_is_kept_until_the_background_write_is_readable(redis_node, tmp_path):
    """The compile stored its entry and returned, but the upload is still under way: a waiter that
    found the lease gone now would read nothing and compile again."""
    a, b = _store(tmp_path / "a", redis_node.url), _store(tmp_path / "b", redis_node.url)
    gate = _gate_remote_writes(a)
    with a.single_flight.scope():
        assert not a.get(KIND, KEY)
        waiter = _Lookup(b)
        until(waiter.waiting)
        assert a.put(KIND, KEY, VALUE)
    assert a.single_flight.holds(KIND, KEY) and len(_lease_keys(redis_node.url)) == 1
    assert waiter.waiting()
    gate.set()
    result = waiter.outcome()
    assert result and result.value == VALUE and result.tier == "remote"
    assert "takeovers" not in b.stats.counters_dict()
    until(lambda: a.single_flight.held == 0 and not _lease_keys(redis_node.url))
    a.close(), b.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_an_entry_saved_at_the_first_backward_keeps_its_lease_however_long_that_compile_takes(
    short_deferral, redis_node, tmp_path
):
    a, b = _store(tmp_path / "a", redis_node.url), _store(tmp_path / "b", redis_node.url)
    gate = _gate_remote_writes(a)
    with a.single_flight.scope():  # the forward's frame compile: a miss, and torch defers the save
        assert not a.get(AOT_KIND, AOT_KEY)
    with a.single_flight.deferred_compile(AOT_KIND, _backward_of_aot_key):  # the lazy backward
        time.sleep(short_deferral)
        assert a.single_flight.holds(AOT_KIND, AOT_KEY) and len(_lease_keys(redis_node.url)) == 1
        waiter = _Lookup(b, AOT_KIND, AOT_KEY)
        until(waiter.waiting)
        time.sleep(short_deferral)
        assert a.put(AOT_KIND, AOT_KEY, VALUE)  # torch's save at the end of the backward compile
    # The backward compile has ended; its entry is still being uploaded, and the lease stays till then.
    assert a.single_flight.holds(AOT_KIND, AOT_KEY) and waiter.waiting()
    gate.set()
    result = waiter.outcome()
    assert result and result.value == VALUE
    assert "takeovers" not in b.stats.counters_dict() and "leases_lapsed" not in a.stats.counters_dict()
    assert a.single_flight.held == 0
    a.close(), b.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_backward_compile_that_saves_nothing_releases_the_lease_when_it_ends(redis_node, tmp_path):
    a, b = _store(tmp_path / "a", redis_node.url), _store(tmp_path / "b", redis_node.url)
    with a.single_flight.scope():
        assert not a.get(AOT_KIND, AOT_KEY)
    assert a.single_flight.holds(AOT_KIND, AOT_KEY)  # kept for the deferred save
    with a.single_flight.deferred_compile(AOT_KIND, lambda key: key == "another entry's"):
        assert a.single_flight.holds(AOT_KIND, AOT_KEY)  # another graph's backward leaves it alone
    with a.single_flight.deferred_compile(AOT_KIND, _backward_of_aot_key):
        waiter = _Lookup(b, AOT_KIND, AOT_KEY)
        until(waiter.waiting)
    # torch chose not to save (a bypass): the waiter takes over at once, not after a timer
    assert a.single_flight.held == 0 and "leases_lapsed" not in a.stats.counters_dict()
    assert not waiter.outcome(timeout=_defaults.LEASE_POLL_S + 5)
    assert b.stats.counters_dict()["takeovers"] == 1
    a.close(), b.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_deferred_lease_lasts_while_the_process_compiles_and_lapses_after(short_deferral, redis_node, tmp_path):
    a = _store(tmp_path / "a", redis_node.url)
    with a.single_flight.scope():
        assert not a.get(AOT_KIND, AOT_KEY)
    with a.single_flight.scope():  # another frame's compile before the first backward (a graph break)
        time.sleep(short_deferral)
        assert a.single_flight.holds(AOT_KIND, AOT_KEY)
    # No backward comes (an evaluation-only function): the lease lapses DEFERRED_MIN_S after the last
    # compile, at the next renewal.
    # (The renewer forgets the lease, then deletes its key: wait for both.)
    until(lambda: a.single_flight.held == 0 and not _lease_keys(redis_node.url), timeout=short_deferral + 5)
    assert a.stats.counters_dict()["leases_lapsed"] == 1
    a.close()


_HOLDER = textwrap.dedent("""
    import sys, time
    from warmstart.compile_cache import open_store
    from warmstart.config import Settings
    store = open_store(Settings.from_env(), persist_stats=False)
    assert not store.get(sys.argv[1], sys.argv[2])
    print("held", flush=True)
    time.sleep(600)
""")


def _holder_process(env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, KIND, KEY], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.parametrize("where", ["remote", "local"])
def test_a_holder_killed_with_sigkill_is_taken_over_within_the_lease_lifetime(where, redis_node, tmp_path):
    url = redis_node.url if where == "remote" else None
    holder_dir = tmp_path / ("a" if where == "remote" else "host")
    holder = _holder_process(_env(holder_dir, url))
    # Bound (docs/compile_cache.md): a Redis lease lapses LEASE_TTL_S after its last renewal, and a
    # waiter looks again within LEASE_POLL_S; the kernel releases a lock file at once. The waiter's
    # own wait bound, five times that, is only a hang guard: a waiter that reached it would stop
    # waiting without taking the lease over (a wait timeout), which the counters below tell apart.
    bound = _defaults.LEASE_TTL_S + _defaults.LEASE_POLL_S + 1.0 if where == "remote" else _defaults.LEASE_POLL_S + 1.0
    b = _store(tmp_path / "b" if where == "remote" else holder_dir, url, WARMSTART_COMPILE_WAIT_S=f"{5 * bound:g}")
    waiter = _Lookup(b)
    until(waiter.waiting)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    result = waiter.outcome()
    assert not result and result.reason == "absent"
    counters = b.stats.counters_dict()
    assert counters["waits"] == 1 and counters["takeovers"] == 1 and "wait_timeouts" not in counters
    lease = b.single_flight._held[(KIND, KEY)]  # the holder's lease is now the waiter's
    assert b.single_flight.held == 1 and lease.local_fd is not None
    if where == "remote":  # SET NX succeeded: the holder's key had lapsed, and only the waiter's is left
        assert lease.remote and len(_lease_keys(redis_node.url)) == 1
    else:
        assert not lease.remote
    b.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_live_holder_is_renewed_past_the_lease_lifetime(redis_node, tmp_path):
    holder = _holder_process(_env(tmp_path / "a", redis_node.url))
    try:
        time.sleep(_defaults.LEASE_TTL_S * 2)
        assert len(_lease_keys(redis_node.url)) == 1  # renewed by the holder's thread
        b = _store(tmp_path / "b", redis_node.url, WARMSTART_COMPILE_WAIT_S="1")
        result = b.get(KIND, KEY)  # waits its bound, then compiles without a lease
        assert not result
        counters = b.stats.counters_dict()
        assert counters["waits"] == 1 and counters["wait_timeouts"] == 1 and "leases" not in counters
        assert b.single_flight.held == 0
        b.close()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_the_server_failing_during_a_wait_means_compiling_at_once(fault, tmp_path):
    node = RedisNode(tmp_path / "redis").start()
    try:
        # One lease poll against a dead server costs at most one operation deadline; then the breaker
        # keeps the tier off and B compiles under its local lock. B's wait bound, five times that, is
        # only a hang guard: reaching it would be a wait timeout, which the counters tell apart.
        bound = _defaults.REMOTE_OP_DEADLINE_S + _defaults.LEASE_POLL_S + 1.0
        a = _store(tmp_path / "a", node.url)
        b = _store(tmp_path / "b", node.url, WARMSTART_COMPILE_WAIT_S=f"{5 * bound:g}")
        assert not a.get(KIND, KEY)
        waiter = _Lookup(b)
        until(waiter.waiting)
        if fault == "stopped":
            node.proc.send_signal(signal.SIGSTOP)  # a server that no longer answers
        else:
            node.kill()
        result = waiter.outcome()
        assert not result
        assert not b.single_flight.remote_leases.connection.breaker.allow()  # the failure opened the breaker
        counters = b.stats.counters_dict()
        assert counters["waits"] == 1 and counters["takeovers"] == 1 and "wait_timeouts" not in counters
        lease = b.single_flight._held[(KIND, KEY)]
        assert b.single_flight.held == 1 and lease.local_fd is not None and not lease.remote
        assert not b.get(KIND, "another-key")  # breaker open: no wait, no server call
        assert b.stats.counters_dict()["waits"] == 1
        a.close(), b.close()
    finally:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)
        node.stop()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_read_only_job_waits_but_never_takes_a_lease(redis_node, tmp_path):
    a = _store(tmp_path / "a", redis_node.url)
    ro = _store(tmp_path / "ro", redis_node.url, WARMSTART_CACHE_MODE="ro")
    assert not a.get(KIND, KEY)
    waiter = _Lookup(ro)
    until(waiter.waiting)
    a.put(KIND, KEY, VALUE)
    assert waiter.outcome().value == VALUE
    # Nobody holds a lease: the read-only job misses and compiles without taking one.
    assert not ro.get(KIND, "fresh-key")
    assert not _lease_keys(redis_node.url) and ro.single_flight.held == 0
    assert "leases" not in ro.stats.counters_dict()
    # A holder that gives up: the read-only job stops waiting and compiles, still without a lease.
    with a.single_flight.scope():
        assert not a.get(KIND, "second-key")
        waiter = _Lookup(ro, key="second-key")
        until(waiter.waiting)
    assert not waiter.outcome()
    assert not _lease_keys(redis_node.url) and "takeovers" not in ro.stats.counters_dict()
    a.close(), ro.close()


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    from _redis import free_port_block, require_redis_server

    from warmstart.server import Credentials, ServerOptions, start, stop

    require_redis_server()
    directory = tmp_path_factory.mktemp("acl") / "server"
    state = start(ServerOptions(dir=directory, port=free_port_block(1)))
    creds = Credentials.load(directory)
    yield state.url("writer", creds), state.url("reader", creds)
    stop(directory)


@pytest.mark.timeout(HANG_GUARD_S)
def test_leases_respect_the_writer_and_reader_acl(acl_server, tmp_path):
    writer_url, reader_url = acl_server
    writer = _store(tmp_path / "w", writer_url)
    reader = _store(tmp_path / "r", reader_url)
    assert not writer.get(KIND, KEY) and _events(writer) == {"leases": 1}
    waiter = _Lookup(reader)  # the reader sees the writer's lease and waits for its entry
    until(waiter.waiting)
    writer.put(KIND, KEY, VALUE)
    assert waiter.outcome().value == VALUE
    # The reader may not take a remote lease (SET is refused): it compiles under its local lock only.
    assert not reader.get(KIND, "reader-miss")
    lease = reader.single_flight._held[(KIND, "reader-miss")]
    assert lease.local_fd is not None and not lease.remote
    writer.close(), reader.close()


def test_leases_are_counted_in_cache_stats(redis_node, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from warmstart.cli import cli

    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path / "runs"))  # this process's miss log, not ./warmstart-runs
    env = _env(tmp_path / "a", redis_node.url)
    store = open_store(Settings.from_env(env))
    assert not store.get(KIND, KEY)
    store.put(KIND, KEY, VALUE)
    store.close()
    out = CliRunner().invoke(cli, ["cache", "stats", "--json"], env=env)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["counters"]["leases"] == 1
    out = CliRunner().invoke(cli, ["cache", "stats"], env=env)
    assert "single-flight" in out.output and "1 lease" in out.output


def test_single_flight_is_off_with_a_zero_wait(redis_node, tmp_path):
    store = _store(tmp_path / "a", redis_node.url, WARMSTART_COMPILE_WAIT_S="0")
    assert store.single_flight is None
    assert not store.get(KIND, KEY) and not _lease_keys(redis_node.url)
    store.close()


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_a_bad_wait_is_one_clear_error(value):
    from warmstart.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        Settings.from_env({"WARMSTART_COMPILE_WAIT_S": value})
    assert "WARMSTART_COMPILE_WAIT_S" in str(info.value) and "seconds" in str(info.value)
    assert "\n" not in str(info.value)


BIG = b"precompiled header" * (_defaults.LOCAL_BACKGROUND_BYTES // 18 + 1)  # a background write


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_large_write_no_one_waits_for_goes_once_the_compile_ends(tmp_path):
    """A precompiled header's compression and writes would come out of the compile on a busy machine:
    held while this process compiles; small entries, and large ones a lease is kept for, are not."""
    store = _store(tmp_path / "host")
    with store.single_flight.scope():
        assert store.put("cpp_object", "header", BIG)  # looked up without a lease: nobody waits for it
        assert store.put(KIND, "small", VALUE)
        assert not store.get("cpp_object", "leased")  # this process compiles it: a lease
        assert store.put("cpp_object", "leased", BIG)
        until(lambda: store.local.get(KIND, "small") and store.local.get("cpp_object", "leased"))
        assert not store.single_flight.holds("cpp_object", "leased")  # released once readable
        time.sleep(0.5)
        assert not store.local.get("cpp_object", "header")  # held back while the compile goes on
    until(lambda: store.local.get("cpp_object", "header"), timeout=10)
    assert store.local.get("cpp_object", "header").value == BIG
    store.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_held_write_waits_out_the_gaps_between_compile_parts_and_goes_at_a_flush(monkeypatch, tmp_path):
    """A compile comes in parts (Dynamo's frames, the backward lowered at the first backward pass):
    the gap between two is no time to write; a flush() is."""
    monkeypatch.setattr(_defaults, "LARGE_WRITE_QUIET_S", 60.0)
    store = _store(tmp_path / "host")
    with store.single_flight.scope():
        assert store.put("cpp_object", "header", BIG)
    time.sleep(0.5)  # between two parts of the compile
    assert not store.local.get("cpp_object", "header")
    with store.single_flight.scope():
        pass
    start = time.monotonic()
    assert store.flush(timeout=10)
    assert time.monotonic() - start < 5  # not the 60 s quiet period
    assert store.local.get("cpp_object", "header").value == BIG
    store.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_held_back_write_goes_at_close_even_inside_a_compile(tmp_path):
    store = _store(tmp_path / "host")
    with store.single_flight.scope():
        assert store.put("cpp_object", "header", BIG)
        start = time.monotonic()
        store.close()
        assert time.monotonic() - start < _defaults.EXIT_FLUSH_S + 1
    reopened = _store(tmp_path / "host")
    assert reopened.get("cpp_object", "header").value == BIG
    reopened.close()


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_lookup_that_does_not_wait_takes_no_lease_and_never_waits(tmp_path):
    a, b = _store(tmp_path / "host"), _store(tmp_path / "host")
    with a.single_flight.scope():
        assert not a.get("cpp_object", "header")  # a holds the lease: a waiting lookup would wait
        start = time.monotonic()
        assert not b.get("cpp_object", "header", wait=False)
        assert time.monotonic() - start < 1
        assert not b.single_flight.holds("cpp_object", "header") and "waits" not in b.stats.counters_dict()
    a.close(), b.close()
