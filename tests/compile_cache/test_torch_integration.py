"""Real torch.compile jobs in subprocesses, each on a "new machine" (fresh HOME, TMPDIR and cache
directories), sharing a real redis-server. Compiled models are shared: one producer fills the cache
and the consumers reuse it.

These jobs run with ``WARMSTART_DYNAMO=0`` (the default): they check the artifacts torch stores itself (FX graphs,
AOTAutograd entries, C++ objects) one by one, which a job with Dynamo frames on never looks up when
the frames load. ``test_dynamo_frames.py`` covers compiled frames."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from _redis import RedisNode, closed_port_url

from warmstart import torch_support

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "benchmarks" / "compile_job.py"
SECRET = "integration-secret"


def run_job(
    tmp: Path,
    *models: str,
    url: str | None = None,
    secret: str | None = SECRET,
    extra_env=None,
    extra_args=(),
    pch: bool = False,
    warmstart: bool = True,
) -> tuple[dict, str]:
    """Run the compile job on a fresh "machine" under ``tmp``; return its result and stderr."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR", "TORCH_COMPILE"))}
    env.update(
        HOME=str(tmp / "home"),
        TMPDIR=str(tmp / "tmp"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        TRITON_CACHE_DIR=str(tmp / "triton"),
        WARMSTART_CACHE_DIR=str(tmp / "warmstart"),
        WARMSTART_RUN_DIR=str(tmp / "runs"),
        WARMSTART_DYNAMO="0",
        TORCHINDUCTOR_COMPILE_THREADS="1",
        # Inductor's vector-ISA build probes (seconds each on a new machine) are not what this checks: passed.
        TORCHINDUCTOR_VEC_ISA_OK="1",
        OMP_NUM_THREADS="1",
        TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="1" if pch else "0",
    )
    (tmp / "tmp").mkdir(exist_ok=True)
    if warmstart:
        env["WARMSTART"] = "1"
        if url:
            env["WARMSTART_CACHE_URL"] = url
        if secret:
            env["WARMSTART_SECRET"] = secret
    env.update(extra_env or {})
    args = [sys.executable, str(JOB)] + [a for m in models for a in ("--model", m)] + list(extra_args)
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(text for text in proc.stdout.splitlines() if text.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), proc.stderr


def remote(result: dict, kind: str) -> dict:
    return result.get("store", {}).get("remote", {}).get(kind, {})


def total(result: dict, tier: str, field: str) -> float:
    return sum(c.get(field, 0) for c in result.get("store", {}).get(tier, {}).values())


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """A redis-server filled by one producer job (tiny model)."""
    node = RedisNode(tmp_path_factory.mktemp("redis")).start()
    machine = tmp_path_factory.mktemp("producer")
    result, _ = run_job(machine, "tiny", url=node.url)
    result["machine"] = machine
    yield node, result
    node.stop()


def test_producer_stores_every_kind(shared_cache):
    node, produced = shared_cache
    kinds = {k.decode().split(":")[3] for k in redis.Redis.from_url(node.url).scan_iter("ws:*:p:*")}
    assert {"fx_graph", "aot_autograd", "cpp_object", "pgo"} <= kinds
    assert produced["inductor"].get("fxgraph_cache_miss", 0) >= 1


def test_hit_across_processes_with_fresh_local_dirs(shared_cache, tmp_path):
    node, produced = shared_cache
    result, stderr = run_job(tmp_path, "tiny", url=node.url)
    assert result["losses"] == produced["losses"]
    # (what a miss was, if one comes: absent, evicted, timed out; and whose server answered)
    misses = "".join(f.read_text()[-2000:] for f in sorted((tmp_path / "runs").glob("cache-misses/*.ndjson")))
    seen = json.dumps({k: result.get(k) for k in ("store", "counters", "inductor", "aot_autograd")})
    seen += f"\nmisses:\n{misses}\nstderr:\n{stderr[-2000:]}"
    assert remote(result, "fx_graph").get("hits", 0) >= 1, seen
    assert remote(result, "aot_autograd").get("hits", 0) == 1
    assert remote(result, "cpp_object").get("hits", 0) >= 1
    assert remote(result, "cpp_object").get("misses", 0) == 0  # g++ never ran
    assert result["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert result["aot_autograd"].get("autograd_cache_hit") == 1


def test_a_new_machine_takes_its_entries_from_one_fetch_ahead(shared_cache, tmp_path):
    """The producer stored the manifest of its lookups: a new machine's lookups take every entry from
    the fetch ahead (begun at its first compile), and none waits on a round trip of its own; with
    ``WARMSTART_FETCH_AHEAD=0`` each remote hit costs at least one. Same losses either way."""
    node, produced = shared_cache
    result, _ = run_job(tmp_path / "on", "tiny", url=node.url)
    off, _ = run_job(tmp_path / "off", "tiny", url=node.url, extra_env={"WARMSTART_FETCH_AHEAD": "0"})
    assert result["losses"] == off["losses"] == produced["losses"]
    hits = total(result, "remote", "hits")
    assert hits >= 3 and total(off, "remote", "hits") == hits
    assert result["counters"]["fetched_ahead_hits"] == hits
    assert result["counters"].get("round_trips", 0) == 0
    assert off["counters"]["round_trips"] >= hits and "fetched_ahead" not in off["counters"]


def test_a_process_that_imports_torch_but_never_compiles_fetches_nothing(shared_cache, tmp_path):
    """A data-loader worker, torchrun's own process: ``import torch`` with warmstart on and the
    producer's manifest on the server opens no connection to it."""
    node, _ = shared_cache
    server = redis.Redis.from_url(node.url)
    before = server.info("stats")["total_connections_received"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR"))}
    env.update(WARMSTART="1", WARMSTART_CACHE_URL=node.url, WARMSTART_SECRET=SECRET, HOME=str(tmp_path))
    env["WARMSTART_CACHE_DIR"] = str(tmp_path / "warmstart")
    code = "import torch; import torch.utils.data; print(torch.ones(2).sum().item())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "2.0", proc.stderr[-2000:]
    assert server.info("stats")["total_connections_received"] == before  # none but this client's own, made before


def test_seconds_saved_count_a_hit_once_and_stay_under_the_cold_compile(shared_cache, tmp_path):
    """The per-kind ``saved_s`` counts nested artifacts again (AOTAutograd > FX graph > C++ object);
    the wall time saved counts each hit's outermost kind, and stays within the cold compile's time."""
    from warmstart.compile_cache.stats import Stats, wall_saved_estimate

    node, produced = shared_cache
    result, _ = run_job(tmp_path, "tiny", url=node.url)
    stats = Stats()
    for kind, counts in result["store"]["remote"].items():
        stats.add("remote", kind, **{k: v for k, v in counts.items() if k in ("hits", "saved_s")})
    nested = total(result, "remote", "saved_s")
    wall = wall_saved_estimate(stats, "remote")
    assert 0 < wall < nested  # the C++ objects' time is inside the FX graph's, counted once
    assert wall <= produced["compile_s"], (wall, produced["compile_s"])


def test_a_job_served_by_torchs_own_local_cache_fills_no_shared_cache(redis_node, tmp_path):
    """As the docs say: torch looks in its own cache on the machine first, so a WARMSTART=1 job after
    a plain one of the same model on that machine asks warmstart nothing and pushes nothing."""
    machine = tmp_path / "machine"
    run_job(machine, "tiny", warmstart=False)
    result, _ = run_job(machine, "tiny", url=redis_node.url)  # the same TORCHINDUCTOR_CACHE_DIR
    assert result["inductor"].get("fxgraph_cache_hit", 0) >= 1  # torch's own local cache served it
    assert remote(result, "fx_graph").get("writes", 0) == 0 and remote(result, "fx_graph").get("hits", 0) == 0
    assert not list(redis.Redis.from_url(redis_node.url).scan_iter("ws:*:p:*fx_graph*"))
    explained = subprocess.run(
        [sys.executable, "-m", "warmstart", "cache", "explain", "--json"],
        env={**os.environ, "WARMSTART_CACHE_DIR": str(machine / "warmstart"), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert explained.returncode == 0, explained.stderr
    advice = json.loads(explained.stdout)["advice"]  # what it missed, torch's own cache aside: said so
    assert any("found in its own cache on this machine (TORCHINDUCTOR_CACHE_DIR)" in line for line in advice), advice


@pytest.mark.slow
def test_precompiled_header_is_never_fetched_on_a_full_hit(redis_node, tmp_path):
    produced, _ = run_job(tmp_path / "a", "tiny2", url=redis_node.url, pch=True)
    assert list((tmp_path / "a" / "tmp").rglob("*.gch"))  # the producer built one
    result, _ = run_job(tmp_path / "b", "tiny2", url=redis_node.url, pch=True)
    assert result["losses"] == produced["losses"]
    assert remote(result, "cpp_object").get("misses", 0) == 0
    assert not list((tmp_path / "b" / "tmp").rglob("*.gch"))
    # the header's name came from the producer's digest of its preprocessed source: no g++ -E here
    assert remote(result, "header_digest").get("hits", 0) >= 1
    assert remote(result, "header_digest").get("misses", 0) == 0


def test_read_only_mode_reads_but_never_writes(shared_cache, tmp_path):
    node, produced = shared_cache
    before = redis.Redis.from_url(node.url).dbsize()
    result, _ = run_job(tmp_path, "tiny", url=node.url, extra_env={"WARMSTART_CACHE_MODE": "ro"})
    assert result["losses"] == produced["losses"]
    assert remote(result, "fx_graph").get("hits", 0) >= 1
    assert redis.Redis.from_url(node.url).dbsize() == before
    assert total(result, "remote", "writes") == 0 and total(result, "local", "writes") == 0


def test_flipped_byte_is_rejected_and_compilation_goes_on(shared_cache, tmp_path):
    node, produced = shared_cache
    client = redis.Redis.from_url(node.url)
    flipped = {}
    for key in list(client.scan_iter("ws:*:p:fx_graph:*")) + list(client.scan_iter("ws:*:p:cpp_object:*"))[:1]:
        value = client.get(key)
        broken = bytearray(value)
        broken[-3] ^= 0x20
        client.set(key, bytes(broken))
        flipped[key] = value
    try:
        result, _ = run_job(tmp_path, "tiny", url=node.url)
    finally:
        for key, value in flipped.items():
            client.set(key, value)
    assert result["losses"] == produced["losses"]
    assert remote(result, "fx_graph").get("rejected", 0) >= 1
    assert remote(result, "fx_graph").get("hits", 0) == 0


def test_wrong_secret_never_loads_and_job_runs(shared_cache, tmp_path):
    node, produced = shared_cache
    client = redis.Redis.from_url(node.url)
    before = {k: client.get(k) for k in client.scan_iter("ws:*:p:*")}
    result, _ = run_job(tmp_path, "tiny", url=node.url, secret="not-the-secret")
    assert result["losses"] == produced["losses"]
    assert total(result, "remote", "hits") == 0
    assert total(result, "remote", "writes") >= 2  # under its own key id ...
    after = {k: client.get(k) for k in client.scan_iter("ws:*:p:*")}
    assert {k: after[k] for k in before} == before  # ... never over the entries of the right secret


def test_missing_secret_warns_once_and_runs_local_only(shared_cache):
    node, produced = shared_cache
    # The producer's machine again (torch's own caches warm, so this costs no compile), but with a
    # fresh warmstart directory and no secret: the remote tier must be refused.
    result, stderr = run_job(
        produced["machine"],
        "tiny",
        url=node.url,
        secret=None,
        extra_env={"WARMSTART_CACHE_DIR": str(produced["machine"] / "warmstart-nosecret")},
    )
    assert result["losses"] == produced["losses"]
    assert "remote" not in result.get("store", {})
    assert stderr.count("no WARMSTART_SECRET") == 1


def test_unreachable_server_from_the_start_costs_one_failed_connection(shared_cache, tmp_path):
    _, produced = shared_cache
    result, stderr = run_job(tmp_path, "tiny", url=closed_port_url())
    assert result["losses"] == produced["losses"]
    # One failed connection, then the breaker kept the server off: the fetch ahead's (on its own
    # thread, as the compiler imported), or a lookup's when fetching ahead had not begun.
    failed = total(result, "remote", "errors") + result["counters"].get("fetch_ahead_failed", 0)
    assert failed == 1
    assert stderr.count("cache tier unavailable") == 1


def test_server_killed_mid_job_costs_one_failed_call(redis_node, tmp_path, shared_cache):
    node, produced = shared_cache
    source, target = redis.Redis.from_url(node.url), redis.Redis.from_url(redis_node.url)
    for key in source.scan_iter("*"):  # this server holds the shared entries, so the first model hits
        target.restore(key, 0, source.dump(key), replace=True)
    result, _ = run_job(
        tmp_path, "tiny", "tiny2", url=redis_node.url, extra_args=["--kill-redis-pid", str(redis_node.proc.pid)]
    )
    assert result["losses"]["tiny"] == produced["losses"]["tiny"]
    assert "tiny2" in result["losses"]  # compiled after the server died
    assert remote(result, "fx_graph").get("hits", 0) >= 1, json.dumps(result.get("store"))
    assert total(result, "remote", "errors") + total(result, "remote", "timeouts") == 1


@pytest.mark.slow
def test_eight_processes_compile_at_once_against_an_empty_cache(redis_node, tmp_path):
    procs = []
    for i in range(8):
        machine = tmp_path / f"m{i}"
        procs.append(machine)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda m: run_job(m, "tiny", url=redis_node.url)[0], procs))
    assert len({json.dumps(r["losses"]) for r in results}) == 1
    from warmstart.compile_cache import RemoteTier
    from warmstart.compile_cache.namespace import namespace

    ns = namespace()
    client = redis.Redis.from_url(redis_node.url)
    checker = RemoteTier(redis_node.url, secret=SECRET.encode(), namespace=ns)
    pointers = [k.decode() for k in client.scan_iter(f"ws:{ns}:p:*")]
    assert pointers
    for key in pointers:
        kind, key_id, entry_key = key[len(f"ws:{ns}:p:") :].split(":", 2)
        assert key_id == checker.key_id
        assert checker.get(kind, entry_key).value is not None, key
    assert checker.stats.get("remote", "fx_graph").rejected == 0


@pytest.mark.slow
def test_hits_against_a_redis_cluster(redis_cluster, tmp_path):
    url = redis_cluster.url
    produced, _ = run_job(tmp_path / "a", "tiny2", url=url, extra_env={"WARMSTART_NAMESPACE": "cluster-test"})
    result, _ = run_job(tmp_path / "b", "tiny2", url=url, extra_env={"WARMSTART_NAMESPACE": "cluster-test"})
    assert result["losses"] == produced["losses"]
    assert remote(result, "fx_graph").get("hits", 0) >= 1
    assert remote(result, "cpp_object").get("hits", 0) >= 1
    assert remote(result, "cpp_object").get("misses", 0) == 0


_BROKEN_STORE_JOB = r"""
import collections, json, torch
from warmstart.compile_cache import set_store

calls = collections.Counter()


class BrokenStore:
    "A store whose every operation raises: warmstart's part must fail open, never torch's compile."

    class stats:
        @staticmethod
        def bump(*args, **kwargs):
            calls["bump"] += 1
            raise RuntimeError("store down")

    def get(self, kind, key):
        calls["get:" + kind] += 1
        raise RuntimeError("store down")

    def put(self, kind, key, data, cost_s=0.0):
        calls["put:" + kind] += 1
        raise RuntimeError("store down")


set_store(BrokenStore())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
compiled = torch.compile(model)
outs = []
for batch in (8, 5):  # the second shape recompiles
    x = torch.randn(batch, 16)
    y = compiled(x)
    y.sum().backward()
    outs.append(torch.allclose(y, model(x)))
print("RESULT " + json.dumps({"ok": outs, "calls": calls}))
"""


def test_a_store_that_raises_costs_caching_never_the_compile(tmp_path):
    """Defence in depth: if warmstart's store raises inside torch's path (Dynamo frames, remote-cache
    get/put, the C++ build, the vector-ISA probe, the recompile counter), torch does what it does
    without warmstart. Dynamo frames on (``WARMSTART_DYNAMO=1``), unlike the other tests here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR", "TORCH_COMPILE"))}
    for name in ("home", "tmp"):
        (tmp_path / name).mkdir()
    env.update(
        HOME=str(tmp_path / "home"),
        TMPDIR=str(tmp_path / "tmp"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"),
        WARMSTART="1",
        WARMSTART_DYNAMO="1",
        WARMSTART_CACHE_DIR=str(tmp_path / "warmstart"),
        WARMSTART_RUN_DIR=str(tmp_path / "runs"),
        TORCHINDUCTOR_COMPILE_THREADS="1",
        OMP_NUM_THREADS="1",
        TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _BROKEN_STORE_JOB], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(text for text in proc.stdout.splitlines() if text.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["ok"] == [True, True]
    calls = result["calls"]
    # compiled frames run only on the torch releases they were checked on (off elsewhere: no lookup)
    frames = torch_support.frames_checked(torch.__version__)
    for kind in ("aot_autograd", "cpp_object", "isa_probe", *(("dynamo_frames",) if frames else ())):
        assert calls.get(f"get:{kind}", 0) >= 1, calls  # every hook ran and met the broken store
    # a C++ object whose lookup failed is built as torch builds it; graphs are bundled into AOTAutograd's entries
    assert calls.get("put:aot_autograd", 0) >= 1 and (not frames or calls.get("put:dynamo_frames", 0) >= 1), calls
    assert calls.get("bump", 0) >= 1, calls
    assert proc.stderr.count("failed (RuntimeError: store down); torch compiles without the cache") == 1, proc.stderr[
        -3000:
    ]  # one warning for the process, not one per lookup
