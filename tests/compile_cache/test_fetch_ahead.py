"""Fetching ahead against real redis-server processes: a manifest stored by a writer, a new
machine's lookups served from one pipelined fetch, and what a wrong, stale, planted or slow one costs."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from warmstart.compile_cache import LocalTier, RemoteTier, TieredStore, open_store
from warmstart.compile_cache.fetch_ahead import (
    AHEAD_FAILED,
    AHEAD_HITS,
    AHEAD_REJECTED,
    MANIFEST,
    FetchAhead,
    ManifestEntry,
    decode,
)
from warmstart.compile_cache.remote_client import TRIPS, TRIPS_AHEAD
from warmstart.compile_cache.signing import generate_key_pair, load_key_file
from warmstart.config import ConfigError, Settings

SECRET = b"fetch-ahead-secret"
PROGRAM = "train.py"


def _tier(url: str, **kw) -> RemoteTier:
    return RemoteTier(url, secret=SECRET, namespace="fa", chunk_bytes=64 * 1024, **kw)


def _machine(tmp_path, name: str, url: str, *, writes: bool, **ahead) -> TieredStore:
    """A new machine's store: an empty local tier, the remote tier with a fetch ahead."""
    remote = _tier(url)
    remote.ahead = FetchAhead(remote, PROGRAM, writes=writes, **ahead)
    return TieredStore(LocalTier(tmp_path / name, 1 << 30), remote, stats=remote.stats, ahead=remote.ahead)


#: Entries of the sizes a warm start looks up: inline records, and blobs of several chunks
#: (incompressible, so they stay that size).
ENTRIES = {
    ("fx_graph", "g1"): b"graph" * 100,
    ("aot_autograd", "a1"): os.urandom(200_000),
    ("cpp_object", "k1"): os.urandom(150_000),
    ("cpp_object", "k2"): b"x" * 10,
    ("isa_probe", "avx2"): b"1",
}


def _fill(tmp_path, url: str) -> TieredStore:
    """A writer looks each entry up (a miss), compiles and stores it, and stores its manifest at exit."""
    writer = _machine(tmp_path, "writer", url, writes=True)
    for (kind, key), value in ENTRIES.items():
        assert not writer.get(kind, key)
        writer.put(kind, key, value)
    writer.close()
    return writer


def test_a_new_machine_takes_every_entry_from_one_fetch(redis_node, tmp_path):
    _fill(tmp_path, redis_node.url)
    reader = _machine(tmp_path, "reader", redis_node.url, writes=False)
    assert reader.ahead.start()
    for (kind, key), value in ENTRIES.items():
        hit = reader.get(kind, key)
        assert (hit.value, hit.tier) == (value, "remote")
    counters = reader.stats.counters_dict()
    assert counters[AHEAD_HITS] == len(ENTRIES)
    assert counters.get(TRIPS, 0) == 0  # no lookup waited on a round trip of its own
    # connect, HELLO, the manifest, one pipeline for every record and chunk
    assert counters[TRIPS_AHEAD] == 4


def test_the_manifest_lists_the_lookups_in_order_with_their_blobs(redis_node, tmp_path):
    writer = _fill(tmp_path, redis_node.url)
    stored = decode(writer.remote.read_manifest(PROGRAM))
    assert [(e.kind, e.key) for e in stored] == list(ENTRIES)
    chunked = {(e.kind, e.key): e for e in stored if e.chunks}
    assert set(chunked) == {("aot_autograd", "a1"), ("cpp_object", "k1")}
    assert all(e.digest and e.size > 64 * 1024 for e in chunked.values())


def test_the_manifest_is_stored_again_only_when_the_lookups_change(redis_node, tmp_path):
    _fill(tmp_path, redis_node.url)
    again = _machine(tmp_path, "again", redis_node.url, writes=True)
    again.ahead.start()
    for kind, key in ENTRIES:
        assert again.get(kind, key)
    assert not again.ahead.save()  # the same lookups: nothing to store
    assert not again.get("fx_graph", "new")
    assert again.ahead.save()
    stored = decode(again.remote.read_manifest(PROGRAM))
    assert [(e.kind, e.key) for e in stored] == [*ENTRIES, ("fx_graph", "new")]


def test_a_process_that_cannot_write_never_stores_a_manifest(redis_node, tmp_path):
    """A verify-only key, or ``WARMSTART_CACHE_MODE=ro``: the manifest is the writers'."""
    priv, pub = tmp_path / "signing.key", tmp_path / "verify.pub"
    generate_key_pair(priv, pub)
    for env in ({"WARMSTART_KEY_FILE": str(pub)}, {"WARMSTART_KEY_FILE": str(priv), "WARMSTART_CACHE_MODE": "ro"}):
        settings = Settings.from_env(
            {"WARMSTART": "1", "WARMSTART_CACHE_URL": redis_node.url, "WARMSTART_CACHE_DIR": str(tmp_path / "c"), **env}
        )
        store = open_store(settings, persist_stats=False)
        assert store.ahead is not None and not store.ahead.writes
        store.get("fx_graph", "g", wait=False)
        store.close()
        assert not store.ahead.save()
    keys = redis.Redis.from_url(redis_node.url).keys(f"*:p:{MANIFEST}:*")
    assert keys == []


def test_fetch_ahead_off_and_a_bad_setting(redis_node, tmp_path):
    base = {"WARMSTART": "1", "WARMSTART_CACHE_URL": redis_node.url, "WARMSTART_SECRET": "s"}
    off = open_store(Settings.from_env({**base, "WARMSTART_FETCH_AHEAD": "0", "WARMSTART_CACHE_DIR": str(tmp_path)}))
    assert off.ahead is None and off.remote.ahead is None
    with pytest.raises(ConfigError, match="WARMSTART_FETCH_AHEAD.*1 or unset"):
        Settings.from_env({**base, "WARMSTART_FETCH_AHEAD": "yes"})


def test_an_entry_fetched_ahead_that_does_not_verify_is_looked_up_again(redis_node, tmp_path):
    _fill(tmp_path, redis_node.url)
    server = redis.Redis.from_url(redis_node.url)
    (pointer,) = server.keys(b"*:p:fx_graph:*:g1")
    good = server.get(pointer)
    server.set(pointer, good[:-1] + bytes([good[-1] ^ 1]))  # one flipped byte
    reader = _machine(tmp_path, "reader", redis_node.url, writes=False)
    reader.ahead.start()
    assert reader.get("isa_probe", "avx2")  # the fetch is done
    server.set(pointer, good)
    hit = reader.get("fx_graph", "g1")
    assert hit.value == ENTRIES[("fx_graph", "g1")]
    counters = reader.stats.counters_dict()
    assert counters[AHEAD_REJECTED] == 1
    assert counters[TRIPS] >= 1  # that one lookup asked the server


def test_a_manifest_that_does_not_verify_leaves_every_lookup_to_the_server(redis_node, tmp_path):
    _fill(tmp_path, redis_node.url)
    server = redis.Redis.from_url(redis_node.url)
    (name,) = server.keys(f"*:p:{MANIFEST}:*".encode())
    server.set(name, b"WS" + os.urandom(200))
    reader = _machine(tmp_path, "reader", redis_node.url, writes=False)
    reader.ahead.start()
    for (kind, key), value in ENTRIES.items():
        assert reader.get(kind, key).value == value
    counters = reader.stats.counters_dict()
    assert counters[AHEAD_FAILED] == 1 and AHEAD_HITS not in counters


def test_a_blob_changed_since_the_manifest_is_fetched_in_a_second_exchange(redis_node, tmp_path):
    """``dynamo_frames`` entries are replaced in place: the manifest names the old blob."""
    writer = _machine(tmp_path, "writer", redis_node.url, writes=True)
    assert not writer.get("dynamo_frames", "f")
    writer.put("dynamo_frames", "f", os.urandom(100_000))
    writer.close()
    newer = os.urandom(120_000)
    assert _tier(redis_node.url).put("dynamo_frames", "f", newer)
    reader = _machine(tmp_path, "reader", redis_node.url, writes=False)
    reader.ahead.start()
    assert reader.get("dynamo_frames", "f").value == newer
    counters = reader.stats.counters_dict()
    assert counters[AHEAD_HITS] == 1 and counters.get(TRIPS, 0) == 0
    assert counters[TRIPS_AHEAD] == 5  # connect, HELLO, manifest, records, the new blob's chunks


def test_an_entry_absent_when_fetched_is_a_miss_once_then_asked_again(redis_node, tmp_path):
    writer = _machine(tmp_path, "writer", redis_node.url, writes=True)
    assert not writer.get("aot_autograd", "backward")  # looked up, never stored
    writer.close()
    reader = _machine(tmp_path, "reader", redis_node.url, writes=False)
    reader.ahead.start()
    assert not reader.get("aot_autograd", "backward", wait=False)
    assert reader.stats.counters_dict().get(TRIPS, 0) == 0
    _tier(redis_node.url).put("aot_autograd", "backward", b"made since")
    assert reader.get("aot_autograd", "backward").value == b"made since"  # a second lookup asks


def test_a_planted_manifest_moves_at_most_its_bound(redis_node, tmp_path):
    """A manifest naming blobs far larger than the bound (signed by a writer, so a writer's fault):
    the fetch skips what is over ``max_bytes``; the lookups go on."""
    _fill(tmp_path, redis_node.url)
    writer = _tier(redis_node.url)
    huge = [ManifestEntry("cpp_object", f"big{i}", "0" * 64, 10_000, 10**12) for i in range(3)]
    entries = decode(writer.read_manifest(PROGRAM))
    from warmstart.compile_cache.fetch_ahead import encode

    writer.write_manifest(PROGRAM, encode(huge + entries))
    reader = _machine(tmp_path, "reader", redis_node.url, writes=False, max_bytes=1 << 20)
    reader.ahead.start()
    for (kind, key), value in ENTRIES.items():
        assert reader.get(kind, key).value == value
    assert reader.stats.counters_dict()[AHEAD_HITS] == len(ENTRIES)


def test_a_stopped_server_costs_a_lookup_at_most_the_fetchs_deadline(redis_node, tmp_path):
    _fill(tmp_path, redis_node.url)
    reader = _machine(tmp_path, "reader", redis_node.url, writes=False, max_bytes=1 << 20)
    reader.remote.op_deadline_s = 0.5
    bound = 2 * 0.5 + 2 * (1 << 20) / reader.remote.min_bytes_per_s
    os.kill(redis_node.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        reader.ahead.start()
        result = reader.get("fx_graph", "g1", wait=False)
        elapsed = time.monotonic() - start
    finally:
        os.kill(redis_node.proc.pid, signal.SIGCONT)
    assert not result  # a miss: the job compiles
    assert elapsed < bound + 1.0, elapsed
    assert reader.stats.counters_dict()[AHEAD_FAILED] == 1


def test_a_forked_child_asks_the_server_itself(redis_node, tmp_path):
    """The fetch and its thread are the parent's: a child forked while it runs must not wait on it."""
    _fill(tmp_path, redis_node.url)
    reader = _machine(tmp_path, "reader", redis_node.url, writes=False)
    reader.ahead.start()
    pid = os.fork()
    if pid == 0:  # the child: the entry from the server, within its own deadline
        try:
            ok = reader.remote.get("fx_graph", "g1").value == ENTRIES[("fx_graph", "g1")]
            os._exit(0 if ok and reader.ahead.take("cpp_object", "k1") is None else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_verify_only_reader_trusts_only_the_writers_key(redis_node, tmp_path):
    """A manifest stored under another key pair is under another key id: never read."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    for d in (mine, theirs):
        d.mkdir()
        generate_key_pair(d / "signing.key", d / "verify.pub")
    other = RemoteTier(redis_node.url, keys=load_key_file(theirs / "signing.key"), namespace="fa")
    other.write_manifest(PROGRAM, b'{"format":1,"entries":[["fx_graph","g1","",0,0]]}')
    reader = RemoteTier(redis_node.url, keys=load_key_file(mine / "verify.pub"), namespace="fa")
    assert reader.read_manifest(PROGRAM) is None


def test_a_writer_that_never_compiled_keeps_the_manifests_entries(redis_node, tmp_path):
    """A process whose lookups came before any compile (a sharding plan, say) never fetched ahead:
    at exit it reads the manifest first, so its own lookups are added, never put in place of it."""
    _fill(tmp_path, redis_node.url)
    planner = _machine(tmp_path, "planner", redis_node.url, writes=True)
    assert not planner.get("sharding_plan", "p")
    planner.close()
    stored = decode(planner.remote.read_manifest(PROGRAM))
    assert [(e.kind, e.key) for e in stored] == [("sharding_plan", "p"), *ENTRIES]


def test_a_value_cheaper_to_make_than_to_wait_for_is_not_fetched_ahead(redis_node, tmp_path):
    """A precompiled header (tens of MB, looked up with ``wait=False`` and only when a kernel misses)
    stays out of the manifest: a warm start never needs it."""
    writer = _machine(tmp_path, "writer", redis_node.url, writes=True)
    assert not writer.get("cpp_object", "header", wait=False, copy_local=False)
    writer.put("cpp_object", "header", os.urandom(300_000))
    assert not writer.get("fx_graph", "g")
    writer.close()
    assert [(e.kind, e.key) for e in decode(writer.remote.read_manifest(PROGRAM))] == [("fx_graph", "g")]


def test_a_lookup_waits_for_the_fetch_no_longer_than_the_process_may_wait(redis_node, tmp_path):
    """The fetch's own deadline here is 2 s and more; the process has 0.3 s left to wait on the cache."""
    from warmstart.compile_cache.wait_budget import WaitBudget

    _fill(tmp_path, redis_node.url)
    remote = _tier(redis_node.url)
    budget = WaitBudget(0.3)
    remote.ahead = FetchAhead(remote, PROGRAM, budget=budget)
    os.kill(redis_node.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        remote.ahead.start()
        fetched = remote.ahead.take("fx_graph", "g1")
        elapsed = time.monotonic() - start
    finally:
        os.kill(redis_node.proc.pid, signal.SIGCONT)
    # Not fetched: the lookup goes on to the server as it would without fetching ahead.
    assert fetched is None
    assert elapsed < 0.3 + 0.5, elapsed  # the budget, and scheduling's slack


def test_a_redis_cluster_serves_the_fetch_in_one_pipeline_per_node(redis_cluster, tmp_path):
    """Entries spread over the cluster's slots: the fetch's pipeline goes to every node that holds
    one, and every lookup is served from it."""
    url = f"{redis_cluster.url}?socket_timeout=30&socket_connect_timeout=30"  # a loaded machine: not a speed test
    _fill(tmp_path, url)
    reader = _machine(tmp_path, "reader", url, writes=False)
    reader.ahead.start()
    for (kind, key), value in ENTRIES.items():
        assert reader.get(kind, key).value == value
    counters = reader.stats.counters_dict()
    assert counters[AHEAD_HITS] == len(ENTRIES) and counters.get(TRIPS, 0) == 0


def test_a_store_built_again_after_the_fetch_ran_waits_for_no_fetch(redis_node, tmp_path):
    # warmstart turned on again in a process whose fetch already ran (WARMSTART=1 at start-up, then
    # warmstart.enable() after Dynamo was imported): the new store must not mark a fetch as under way
    # that no thread will run (each lookup would wait for it, up to its deadline); its fetch begins
    # at the next compile's start instead.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import time
        from warmstart import compile_cache as cc
        cc.fetch_ahead_when_compiling(True)
        cc.fetch_ahead_now()  # as at Dynamo's import
        first = None
        for _ in range(200):
            first = cc.get_store()
            if first is not None and first.ahead is not None and first.ahead._done.is_set():
                break
            time.sleep(0.05)
        assert first.ahead._done.is_set(), "the first fetch never ran"
        cc.reset_store()  # as warmstart.enable() does
        store = cc.get_store()
        start = time.monotonic()
        store.get("fx_graph", "never-stored")
        print(f"lookup {time.monotonic() - start:.2f}")
        cc.fetch_ahead_now()  # as at the next compile's start
        print("fetched" if store.ahead._done.wait(20) else "not fetched")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
    env.update(
        WARMSTART="1",
        WARMSTART_CACHE_URL=redis_node.url,
        WARMSTART_SECRET=SECRET.decode(),
        WARMSTART_CACHE_DIR=str(tmp_path / "cache"),
        HOME=str(tmp_path),
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split()
    assert lines[0] == "lookup" and float(lines[1]) < 2.0, done.stdout
    assert lines[2] == "fetched", done.stdout
