"""The store against real redis-server processes: tiers, signing, chunking, races, failure modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import redis
from _wait import until

from warmstart.compile_cache import LocalTier, RemoteTier, TieredStore, open_store
from warmstart.compile_cache.stats import Stats
from warmstart.compile_cache.storage import BREAKER_OPEN, ERROR
from warmstart.config import Settings

SECRET = b"test-secret"


def _remote(url: str, secret: bytes = SECRET, ns: str = "t", **kw) -> RemoteTier:
    return RemoteTier(url, secret=secret, namespace=ns, **kw)


def test_a_value_the_caller_keeps_itself_is_not_copied_into_the_local_tier(redis_node, tmp_path):
    """``copy_local=False`` (a precompiled header, which its reader writes in place itself): a hit
    from the remote tier is returned and left out of the local tier; by default it is copied."""
    writer = TieredStore(LocalTier(tmp_path / "a", 1 << 30), _remote(redis_node.url))
    payload = os.urandom(300_000)
    writer.put("cpp_object", "header", payload)
    writer.put("cpp_object", "kernel", b"k" * 1000)
    assert writer.flush(timeout=10)
    reader = TieredStore(LocalTier(tmp_path / "b", 1 << 30), _remote(redis_node.url))
    hit = reader.get("cpp_object", "header", wait=False, copy_local=False)
    assert (hit.value, hit.tier) == (payload, "remote")
    assert reader.get("cpp_object", "kernel").tier == "remote"
    assert reader.flush(timeout=10)
    assert not reader.local.get("cpp_object", "header")  # left out
    assert reader.local.get("cpp_object", "kernel").value == b"k" * 1000  # copied, as before


def test_the_remote_client_reads_a_mebibyte_per_socket_read(redis_node):
    """A thread that fetches while another runs Python waits for the GIL after every socket read:
    the client asks for 1 MiB per read (redis-py's default is 64 KiB), and a value of many reads
    still comes back whole."""
    from warmstart import _defaults
    from warmstart.compile_cache.remote_client import connect

    client = connect(redis_node.url)
    assert client.connection_pool.connection_kwargs["socket_read_size"] == _defaults.REMOTE_SOCKET_READ_BYTES
    assert _defaults.REMOTE_SOCKET_READ_BYTES == 1 << 20
    value = os.urandom(5 * (1 << 20) + 123)
    client.set("big", value)
    assert client.get("big") == value


def test_remote_round_trip_and_backfill(redis_node, tmp_path):
    writer = TieredStore(LocalTier(tmp_path / "a", 1 << 30), _remote(redis_node.url))
    payload = os.urandom(50_000) + b"x" * 200_000
    writer.put("fx_graph", "k1", payload, cost_s=3.0)
    assert writer.flush(timeout=10)
    reader = TieredStore(LocalTier(tmp_path / "b", 1 << 30), _remote(redis_node.url))
    remote_hit = reader.get("fx_graph", "k1")
    assert (remote_hit.value, remote_hit.tier) == (payload, "remote")
    assert reader.stats.get("remote", "fx_graph").hits == 1
    assert reader.flush(timeout=10)  # the backfill into the local tier runs in the background
    local_hit = reader.get("fx_graph", "k1")
    assert (local_hit.value, local_hit.tier) == (payload, "local")  # now from the local tier
    assert reader.stats.get("local", "fx_graph").hits == 1
    assert reader.stats.get("remote", "fx_graph").hits == 1
    # Each hit carries the producer's cost (the backfill kept it), and "seconds saved" is that cost
    # less the read time: what the code computes, not how fast this machine is.
    assert remote_hit.cost_s + local_hit.cost_s == pytest.approx(6.0)
    for tier in ("remote", "local"):
        counts = reader.stats.get(tier, "fx_graph")
        assert counts.saved_s + counts.read_s == pytest.approx(3.0), (tier, counts)


def test_large_values_are_chunked_and_identical_blobs_stored_once(redis_node):
    tier = _remote(redis_node.url, chunk_bytes=64 * 1024)
    payload = os.urandom(300 * 1024)  # incompressible: 5 chunks
    assert tier.put("cpp_object", "a", payload)
    assert tier.put("cpp_object", "b", payload)  # same content under another key
    client = redis.Redis.from_url(redis_node.url)
    blob_keys = [k for k in client.scan_iter("ws:t:b:*")]
    assert len(blob_keys) == 5
    assert _remote(redis_node.url).get("cpp_object", "b").value == payload


def test_first_writer_wins(redis_node):
    a, b = _remote(redis_node.url), _remote(redis_node.url)
    assert a.put("pgo", "k", b"first")
    assert b.put("pgo", "k", b"second")
    assert _remote(redis_node.url).get("pgo", "k").value == b"first"


def test_pointer_to_evicted_blob_is_a_miss_and_is_repaired(redis_node):
    tier = _remote(redis_node.url)
    tier.put("fx_graph", "k", os.urandom(200_000))
    client = redis.Redis.from_url(redis_node.url)
    for key in client.scan_iter("ws:t:b:*"):
        client.delete(key)
    assert tier.get("fx_graph", "k").value is None
    fresh = os.urandom(200_000)
    assert tier.put("fx_graph", "k", fresh)
    assert tier.get("fx_graph", "k").value == fresh


def test_small_values_are_inline_in_one_signed_record(redis_node):
    tier = _remote(redis_node.url)
    assert tier.put("pgo", "small", b"state" * 1000)
    client = redis.Redis.from_url(redis_node.url)
    pointer = f"ws:t:p:pgo:{tier.key_id}:small"
    assert sorted(k.decode() for k in client.scan_iter("ws:t:*")) == ["ws:t:index", pointer]  # no blob
    assert client.smembers("ws:t:index") == {pointer.encode()}  # what `cache clear` deletes
    assert _remote(redis_node.url).get("pgo", "small").value == b"state" * 1000


def test_incompressible_values_are_stored_raw(redis_node):
    tier = _remote(redis_node.url)
    payload = os.urandom(1_000_000)
    assert tier.put("cpp_object", "so", payload)
    client = redis.Redis.from_url(redis_node.url)
    stored = sum(client.strlen(k) for k in client.scan_iter("ws:t:b:*"))
    assert stored == len(payload)
    assert _remote(redis_node.url).get("cpp_object", "so").value == payload


@pytest.mark.parametrize("target,size", [("pointer", 4000), ("pointer", 200_000), ("blob", 200_000)])
def test_flipped_byte_is_rejected(redis_node, target, size):
    tier = _remote(redis_node.url)
    tier.put("fx_graph", "k", os.urandom(size))
    client = redis.Redis.from_url(redis_node.url)
    key = next(client.scan_iter(f"ws:t:{'p' if target == 'pointer' else 'b'}:*"))
    value = bytearray(client.get(key))
    value[len(value) // 2] ^= 0x01
    client.set(key, bytes(value))
    reader = _remote(redis_node.url)
    assert reader.get("fx_graph", "k").value is None
    counts = reader.stats.get("remote", "fx_graph")
    assert (counts.rejected, counts.misses, counts.hits) == (1, 1, 0)


def test_wrong_secret_never_returns_the_entry(redis_node):
    owner = _remote(redis_node.url)
    owner.put("aot_autograd", "k", b"payload" * 100)
    intruder = _remote(redis_node.url, secret=b"another-secret")
    assert intruder.key_id != owner.key_id
    assert intruder.get("aot_autograd", "k").value is None  # its own key id: nothing there
    # A record signed under another secret, planted under the owner's key, is refused.
    intruder.put("aot_autograd", "k", b"evil" * 100)
    client = redis.Redis.from_url(redis_node.url)
    client.set(owner._pointer_key("aot_autograd", "k2"), client.get(intruder._pointer_key("aot_autograd", "k")))
    assert owner.get("aot_autograd", "k2").value is None
    assert owner.stats.get("remote", "aot_autograd").rejected == 1


@pytest.mark.parametrize("size", [3000, 300_000])
def test_a_writer_with_another_secret_never_replaces_entries(redis_node, size):
    """A job given the wrong secret (or one still on the old secret during a rotation) writes the
    same keys: the entries of the jobs holding the right secret stay as they are."""
    value = os.urandom(size)
    _remote(redis_node.url).put("fx_graph", "k", value)
    other = _remote(redis_node.url, secret=b"old-secret")
    assert other.get("fx_graph", "k").value is None
    assert other.put("fx_graph", "k", os.urandom(size))
    reader = _remote(redis_node.url)
    assert reader.get("fx_graph", "k").value == value
    assert reader.stats.get("remote", "fx_graph").rejected == 0


def test_pointer_cannot_be_replayed_under_another_key(redis_node):
    tier = _remote(redis_node.url)
    tier.put("fx_graph", "good", b"a" * 3000)
    client = redis.Redis.from_url(redis_node.url)
    client.set(f"ws:t:p:fx_graph:{tier.key_id}:evil", client.get(f"ws:t:p:fx_graph:{tier.key_id}:good"))
    assert tier.get("fx_graph", "evil").value is None
    assert tier.stats.get("remote", "fx_graph").rejected == 1


def test_missing_secret_refuses_remote_tier_with_one_warning(redis_node, tmp_path, caplog):
    settings = Settings.from_env(
        {"WARMSTART": "1", "WARMSTART_CACHE_URL": redis_node.url, "WARMSTART_CACHE_DIR": str(tmp_path)}
    )
    store = open_store(settings, persist_stats=False)
    assert store.remote is None and store.local is not None
    assert any("no WARMSTART_SECRET" in r.message for r in caplog.records)


def test_read_only_mode_never_writes(redis_node, tmp_path):
    env = {
        "WARMSTART": "1",
        "WARMSTART_CACHE_URL": redis_node.url,
        "WARMSTART_SECRET": "s",
        "WARMSTART_CACHE_DIR": str(tmp_path / "ro"),
        "WARMSTART_CACHE_MODE": "ro",
    }
    store = open_store(Settings.from_env(env), persist_stats=False)
    store.put("fx_graph", "k", b"x" * 1000, sync=True)
    store.put("fx_graph", "k2", b"y" * 1000)
    store.flush(timeout=5)
    assert redis.Redis.from_url(redis_node.url).dbsize() == 0
    assert len(store.local.storage) == 0
    # and it still reads what a writer stored
    writer_env = dict(env, WARMSTART_CACHE_MODE="rw", WARMSTART_CACHE_DIR=str(tmp_path / "rw"))
    writer = open_store(Settings.from_env(writer_env), persist_stats=False)
    writer.put("fx_graph", "k", b"x" * 1000, sync=True)
    assert store.get("fx_graph", "k").value == b"x" * 1000
    assert len(store.local.storage) == 0


def test_dead_server_costs_one_failure_then_breaker(tmp_path):
    from _redis import closed_port_url

    tier = _remote(closed_port_url())
    reasons = []
    for i in range(50):
        result = tier.get("fx_graph", f"k{i}")
        assert result.value is None
        reasons.append(result.reason)
        assert tier.put("fx_graph", f"k{i}", b"v") is False
    counts = tier.stats.get("remote", "fx_graph")
    assert counts.errors == 1  # only the first call reached the network: the breaker kept the rest off it
    assert counts.misses == 50 and counts.dropped == 50
    assert not tier.breaker.allow()
    assert reasons == [ERROR] + [BREAKER_OPEN] * 49  # a refused connection, then the breaker


def test_server_killed_mid_job_then_breaker_then_recovery(redis_node):
    tier = _remote(redis_node.url)
    tier.breaker._cooldown_s = 0.2
    assert tier.put("pgo", "k", b"v")
    redis_node.kill()
    assert tier.get("pgo", "k").reason is ERROR
    assert not tier.breaker.allow()
    assert tier.get("pgo", "k").reason is BREAKER_OPEN
    assert tier.stats.get("remote", "pgo").errors == 1
    redis_node.start()  # same port, empty
    until(tier.breaker.allow, timeout=10, poll_s=0.05)
    assert tier.put("pgo", "k", b"again") and tier.get("pgo", "k").value == b"again"


def test_local_size_limit_holds(tmp_path):
    limit = 2 * 1024 * 1024
    tier = LocalTier(tmp_path, limit)
    for i in range(60):
        tier.put("cpp_object", f"k{i}", os.urandom(100 * 1024))
    assert tier.volume() <= limit * 1.1  # diskcache culls on write; its SQLite file is counted too
    assert tier.get("cpp_object", "k59").value is not None  # most recent kept
    assert tier.get("cpp_object", "k0").value is None  # least recent evicted


def test_cluster_hits(redis_cluster, tmp_path):
    # Where entries land is what this checks, not how fast: on a loaded machine three redis-servers
    # may answer the first slot discovery later than the default socket timeouts, and the tier then
    # steps aside as it should (tests/compile_cache/test_faults.py bounds that).
    url = f"{redis_cluster.url}?socket_timeout=30&socket_connect_timeout=30"
    writer = TieredStore(LocalTier(tmp_path / "a", 1 << 30), _remote(url, ns="cl", chunk_bytes=32 * 1024))
    payloads = {f"k{i}": os.urandom(100_000) for i in range(10)}
    for key, value in payloads.items():
        writer.put("fx_graph", key, value)
    assert writer.flush(timeout=20)
    reader = TieredStore(LocalTier(tmp_path / "b", 1 << 30), _remote(url, ns="cl"))
    for key, value in payloads.items():
        assert reader.get("fx_graph", key).value == value
    assert reader.stats.get("remote", "fx_graph").hits == 10
    # keys really are spread over the cluster's nodes
    assert sum(1 for n in redis_cluster.nodes if redis.Redis(port=n.port).dbsize() > 0) >= 2


_RACER = textwrap.dedent("""
    import json, sys
    from warmstart.compile_cache import RemoteTier

    url, i = sys.argv[1], int(sys.argv[2])
    tier = RemoteTier(url, secret=b"test-secret", namespace="t")
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    ok = tier.put("fx_graph", "same", f"value-{i}".encode() * 500)
    value = tier.get("fx_graph", "same").value
    print(json.dumps({"ok": ok, "value": value.decode() if value is not None else None}), flush=True)
""")


def test_racing_writers_all_succeed_and_agree(redis_node):
    # Separate interpreters (not forks of this one: its threads may hold locks at the fork), released
    # at once when every one is ready.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, redis_node.url, str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outcomes = [json.loads(proc.communicate(timeout=60)[0]) for proc in procs]  # hang guard
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0] * len(procs)
    assert all(o["ok"] for o in outcomes)
    values = {o["value"] for o in outcomes}
    assert len(values) == 1 and values.pop() is not None


def test_stats_merge_across_processes(tmp_path):
    path = tmp_path / "stats.json"
    for _ in range(3):
        s = Stats()
        s.add("remote", "fx_graph", hits=2, bytes_read=10)
        s.bump("recompiles")
        s.merge_into(path)
    from warmstart.compile_cache.stats import load

    total = load(path)
    assert total.get("remote", "fx_graph").hits == 6
    assert total.counters_dict() == {"recompiles": 3}


@pytest.mark.parametrize(
    "option,stored_smaller", [("compress=off", False), ("compress=-5", True), ("compress=9", True)]
)
def test_compression_is_a_url_option_and_readers_handle_any(redis_node, option, stored_smaller):
    value = b"def forward(self, x):\n    return torch.relu(x)\n" * 20_000  # ~1 MB of generated code
    writer = _remote(f"{redis_node.url}?{option}")
    assert writer.put("fx_graph", "k", value)
    client = redis.Redis.from_url(redis_node.url)
    stored = sum(client.strlen(k) for k in client.scan_iter("ws:t:b:*"))
    assert (stored < len(value) // 4) is stored_smaller
    assert _remote(redis_node.url).get("fx_graph", "k").value == value


@pytest.mark.parametrize("value", ["fast", "23", "-101", ""])
def test_bad_compress_option_is_one_line_naming_it(value):
    from warmstart.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        Settings.from_env({"WARMSTART": "1", "WARMSTART_CACHE_URL": f"redis://127.0.0.1:6379/0?compress={value}"})
    message = str(info.value)
    assert "\n" not in message and "compress" in message and "zstd level" in message


def test_remote_reads_are_cache_fetch_spans_in_the_ett_events(redis_node, tmp_path, monkeypatch):
    from warmstart.metrics import CacheSpans, reset_process_recorder
    from warmstart.metrics.calculator import compute, load_runs
    from warmstart.metrics.recorder import get_recorder

    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("WARMSTART_JOB_ID", "fetch-spans")
    try:
        _remote(redis_node.url).put("fx_graph", "k", b"graph" * 10_000)
        store = TieredStore(LocalTier(tmp_path / "local", 1 << 30), _remote(redis_node.url), observers=[CacheSpans()])
        rec = get_recorder()
        rec.attempt_start()
        assert store.get("fx_graph", "k").value == b"graph" * 10_000  # remote: one span
        store.flush(timeout=10)
        assert store.get("fx_graph", "k").value is not None  # local now: no span
        rec.step(0)
        rec.train_end()
        rec.attempt_end()
        rec.flush()
        store.close()
        events = [json.loads(text) for f in (tmp_path / "run").rglob("*.jsonl") for text in f.read_text().splitlines()]
        fetches = [e for e in events if e.get("span") == "cache_fetch"]
        assert [(e["event"], e["bucket"]) for e in fetches] == [("begin", "compile"), ("end", "compile")]
        result = compute(load_runs([tmp_path / "run"])[0])
        assert result.buckets["compile"] > 0
    finally:
        reset_process_recorder()


def test_a_remote_read_never_starts_recording_in_a_process_that_records_nothing(redis_node, tmp_path, monkeypatch):
    """Inductor's compile workers read the cache too: they must not begin writing the job's events
    (their exit would then record a failure for the job's attempt)."""
    from warmstart.metrics.recorder import existing_recorder

    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path / "run"))
    _remote(redis_node.url).put("fx_graph", "k", b"graph" * 10_000)
    store = TieredStore(None, _remote(redis_node.url))
    assert store.get("fx_graph", "k").value == b"graph" * 10_000
    store.close()
    assert existing_recorder() is None
    assert not (tmp_path / "run").exists()


def test_a_large_value_is_written_locally_off_the_callers_path(tmp_path, monkeypatch):
    """A precompiled header (150 MB) goes to the local tier from the background writer, which runs
    below the compile in CPU priority; small values are written at once."""
    import threading

    from warmstart import _defaults

    store = open_store(
        Settings.from_env({"WARMSTART": "1", "WARMSTART_CACHE_DIR": str(tmp_path / "cache")}), persist_stats=False
    )
    callers = []
    original = store.local.put
    monkeypatch.setattr(
        store.local, "put", lambda *a, **k: callers.append(threading.current_thread().name) or original(*a, **k)
    )
    try:
        value = os.urandom(_defaults.LOCAL_BACKGROUND_BYTES + 1)
        assert store.put("cpp_object", "pch", value) and store.put("cpp_object", "small", b"x")
        assert store.flush(timeout=60)
        assert store.local.get("cpp_object", "pch").value == value
        assert callers == ["warmstart-cache-writer", "MainThread"] or callers == [
            "MainThread",
            "warmstart-cache-writer",
        ]
        writer = next(t for t in threading.enumerate() if t.name == "warmstart-cache-writer")
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) >= _defaults.WRITER_NICE
    finally:
        store.close()


def test_counts_handed_to_the_stats_file_stay_in_the_process_totals(tmp_path):
    """A store hands its counts to ``stats.json`` at exit and starts again from zero; what the process
    counted so far (a dashboard's counter) must neither drop nor count twice."""
    stats = Stats()
    stats.add("local", "fx_graph", hits=2, misses=1)
    stats.take().merge_into(tmp_path / "stats.json")
    stats.add("local", "fx_graph", hits=1)
    stats.add("remote", "triton", misses=4)
    totals = {key: (c.hits, c.misses) for key, c in stats.totals()}
    assert totals == {("local", "fx_graph"): (3, 1), ("remote", "triton"): (0, 4)}
    assert {key: (c.hits, c.misses) for key, c in stats.items()} == {
        ("local", "fx_graph"): (1, 0),
        ("remote", "triton"): (0, 4),
    }
    stats.take().merge_into(tmp_path / "stats.json")
    assert json.loads((tmp_path / "stats.json").read_text())["tiers"]["local"]["fx_graph"]["hits"] == 3
