"""The Triton cache manager's interface, on CPU, against a real store (local tier + real Redis)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _redis import in_ci
from _triton_protocol import METADATA, compile_as_triton_does

from warmstart.compile_cache import LocalTier, RemoteTier, TieredStore, set_store
from warmstart.compile_cache.triton_manager import CacheManager, WarmstartCacheManager

PROTOCOL = Path(__file__).resolve().parent / "_triton_protocol.py"
COMPILE_JOB = Path(__file__).resolve().parent / "_triton_compile_job.py"


@pytest.fixture
def machine(tmp_path, monkeypatch, redis_node):
    """Return a function that makes a new "machine": fresh Triton dir and local tier, shared Redis."""

    def new(name: str) -> None:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / name / "triton"))
        set_store(
            TieredStore(
                LocalTier(tmp_path / name / "ws", 1 << 30), RemoteTier(redis_node.url, secret=b"s", namespace="tri")
            )
        )

    yield new
    set_store(None)


def test_is_a_cache_manager():
    assert any(c.__name__ == "CacheManager" for c in WarmstartCacheManager.__mro__)
    assert issubclass(WarmstartCacheManager, CacheManager)


def test_kernel_files_and_groups_move_between_machines(machine):
    machine("a")
    m = WarmstartCacheManager("KEYABC")
    cubin = os.urandom(5000)
    paths = {"k.cubin": m.put(cubin, "k.cubin"), "k.json": m.put('{"name": "k"}', "k.json", binary=False)}
    m.put_group("k.json", paths)
    from warmstart.compile_cache import get_store

    get_store().flush(timeout=10)

    machine("b")
    m2 = WarmstartCacheManager("KEYABC")
    local_cubin = os.path.join(m2.cache_dir, "k.cubin")
    assert not os.path.exists(local_cubin)
    # A local miss goes to the store: machine a's file, written into this machine's directory.
    assert m2.get_file("k.cubin") == local_cubin
    with open(local_cubin, "rb") as f:
        assert f.read() == cubin
    group = m2.get_group("k.json")
    assert group is not None and set(group) == {"k.cubin", "k.json"}
    assert open(group["k.cubin"], "rb").read() == cubin
    assert all(p.startswith(m2.cache_dir) for p in group.values())  # relocated to this machine
    with open(m2.get_file("__grp__k.json")) as f:
        assert json.load(f)["child_paths"]["k.json"] == os.path.join(m2.cache_dir, "k.json")


def test_local_first_no_store_lookup_when_present(machine):
    machine("a")
    m = WarmstartCacheManager("K2")
    m.put(b"data", "f.bin")
    from warmstart.compile_cache import get_store

    store = get_store()
    before = store.stats.get("remote", "triton_kernel")
    assert m.get_file("f.bin") == os.path.join(m.cache_dir, "f.bin")
    after = store.stats.get("remote", "triton_kernel")
    assert (after.hits, after.misses) == (before.hits, before.misses)


def test_group_with_a_missing_child_is_a_miss(machine):
    machine("a")
    m = WarmstartCacheManager("K3")
    m.put_group("x.json", {"x.cubin": "/elsewhere/x.cubin"})
    from warmstart.compile_cache import get_store

    get_store().flush(timeout=10)
    machine("b")
    assert WarmstartCacheManager("K3").get_group("x.json") is None


def test_override_and_dump_managers_stay_local(machine, tmp_path, monkeypatch):
    machine("a")
    monkeypatch.setenv("TRITON_DUMP_DIR", str(tmp_path / "dump"))
    m = WarmstartCacheManager("K4", dump=True)
    m.put(b"ir", "k.ttir")
    from warmstart.compile_cache import get_store

    get_store().flush(timeout=10)
    assert m.cache_dir.startswith(str(tmp_path / "dump"))
    assert get_store().stats.get("remote", "triton_kernel").writes == 0


@pytest.mark.parametrize("name", ["../../evil", "/etc/passwd", "..", "sub/k.cubin", "nul\0.bin"])
def test_group_entries_naming_files_outside_the_kernel_dir_are_misses(machine, tmp_path, name):
    machine("a")
    from warmstart.compile_cache import get_store
    from warmstart.compile_cache.triton_manager import KIND

    store = get_store()
    # Entries as a writer to the cache could make them: a group naming the file, and the file.
    store.put(
        KIND, "K5/__grp__k.json", json.dumps({"child_paths": {name: "/anywhere", "k.json": "/x"}}).encode(), sync=True
    )
    store.put(KIND, f"K5/{name}", b"evil", sync=True)
    store.put(KIND, "K5/k.json", b"{}", sync=True)
    store.flush(timeout=10)
    machine("b")
    m = WarmstartCacheManager("K5")
    assert m.get_group("k.json") is None
    assert m.get_file(name) is None
    assert not (tmp_path / "b" / "evil").exists() and not (tmp_path / "evil").exists()
    assert os.listdir(m.cache_dir) == []  # not even the group file: the entry was refused whole


def test_malformed_group_entries_are_misses(machine):
    machine("a")
    from warmstart.compile_cache import get_store
    from warmstart.compile_cache.triton_manager import KIND

    for i, data in enumerate([b"[1, 2]", b'{"child_paths": 3}', b"\xff\xfe", b'{"child_paths": ["a", "b"]}']):
        get_store().put(KIND, f"K6/__grp__{i}.json", data, sync=True)
    get_store().flush(timeout=10)
    machine("b")
    m = WarmstartCacheManager("K6")
    assert all(m.get_group(f"{i}.json") is None for i in range(4))


@pytest.mark.parametrize("name", ["../x", "/tmp/x", ""])
def test_unplain_names_from_triton_itself_are_refused(machine, name):
    machine("a")
    m = WarmstartCacheManager("K7")
    with pytest.raises(ValueError):
        m.put(b"data", name)
    with pytest.raises(ValueError):
        m.put_group("k.json", {name: "/x"})


def test_a_kernel_compile_that_ends_without_writing_releases_its_lease(redis_node, tmp_path, monkeypatch):
    """Triton calls nothing on its manager when a compile raises: the lease its group miss took
    (single-flight) ends with the manager, and a completed compile's put_group releases it first."""
    import gc

    from warmstart.compile_cache.single_flight import SingleFlight
    from warmstart.compile_cache.stats import Stats

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    remote = RemoteTier(redis_node.url, secret=b"s", namespace="tri")
    stats = Stats()
    flight = SingleFlight(
        local_dir=tmp_path / "ws", local_writable=True, remote_leases=remote.leases, remote_writable=True, stats=stats
    )
    set_store(TieredStore(LocalTier(tmp_path / "ws", 1 << 30), remote, stats=stats, single_flight=flight))
    try:
        m = WarmstartCacheManager("FAILS")
        assert m.get_group("k.json") is None
        assert flight.holds("triton_kernel", "FAILS/__grp__k.json")
        del m  # the compile raised: Triton drops its manager
        gc.collect()
        assert not flight.holds("triton_kernel", "FAILS/__grp__k.json")

        m = WarmstartCacheManager("WORKS")
        assert m.get_group("k.json") is None and flight.held == 1
        m.put_group("k.json", {"k.json": m.put(b"{}", "k.json")})
        from warmstart.compile_cache import get_store

        get_store().flush(timeout=10)
        assert flight.held == 0 and stats.counters_dict()["leases"] == 2
    finally:
        set_store(None)


# -- the calls Triton's compile() makes ----------------------------------------------------------


def test_a_kernel_compiled_the_way_triton_compiles_is_found_whole_on_a_new_machine(machine):
    machine("a")
    m = WarmstartCacheManager("KCOMPILE")
    cubin = os.urandom(3000)
    group = compile_as_triton_does(m, cubin)
    # The group lives in its own file: the metadata Triton reads back from the group is still the metadata.
    assert json.loads(open(group["k.json"]).read()) == METADATA
    assert m.get_group("k.json") == group  # the next compile in this process: a local hit
    from warmstart.compile_cache import get_store

    get_store().flush(timeout=10)

    machine("b")
    found = WarmstartCacheManager("KCOMPILE").get_group("k.json")
    assert found is not None and set(found) == set(group)
    assert open(found["k.ttir"]).read() == "module { tt.func @k() }"
    assert open(found["k.cubin"], "rb").read() == cubin
    assert json.loads(open(found["k.json"]).read()) == METADATA


#: The Triton ``make setup`` installs beside the venv (``pip install --target``), outside the venv's
#: own packages: torch must not find it, and only the children of the tests below import it.
TRITON_REFERENCE = Path(sys.prefix) / "triton-reference"


def _with_triton(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that imports Triton: the Triton installed here (GPU machines), else the
    reference Triton. Skips the test where there is neither (fails it under CI)."""
    env = {k: v for k, v in env.items() if not k.startswith("TRITON")}
    if importlib.util.find_spec("triton") is None:
        if not TRITON_REFERENCE.is_dir():
            reason = f"no Triton to compare with: not installed, and no {TRITON_REFERENCE} (make setup installs it)"
            if in_ci():
                pytest.fail(f"{reason}; CI is set, where `make test` installs it", pytrace=False)
            pytest.skip(reason)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TRITON_REFERENCE), env.get("PYTHONPATH")]))
    return env


def _run(script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_calls_triton_makes_leave_the_files_its_own_manager_leaves(tmp_path):
    """The same calls through Triton's own ``FileCacheManager``: the same files with the same bytes, a
    group naming the same children, and the same group for the next compile."""
    env = _with_triton({k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")})
    proc = _run(PROTOCOL, str(tmp_path), env=env)
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_a_kernel_triton_compiled_on_one_machine_is_not_compiled_again_on_another(tmp_path, redis_node):
    """Triton's own ``compile()`` (sm_90, assembled by its ptxas: no GPU needed) on a new machine with
    ``WARMSTART=1``: warmstart hands Triton its manager, and the kernel goes to the shared cache. A
    second new machine gets Triton's cache hit from it, with the same cubin."""
    from _machine import machine_env

    from warmstart.compile_cache.signing import generate_key_pair

    generate_key_pair(tmp_path / "signing.key", tmp_path / "verify.pub")
    results = {}
    for name, key in (("producer", "signing.key"), ("new machine", "verify.pub")):
        env = machine_env(tmp_path / name, WARMSTART_CACHE_URL=redis_node.url, WARMSTART_KEY_FILE=str(tmp_path / key))
        proc = _run(COMPILE_JOB, env=_with_triton(env))
        results[name] = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    producer, new = results["producer"], results["new machine"]
    assert producer["manager"] == "warmstart.compile_cache.triton_manager:WarmstartCacheManager"
    assert producer["cache_hit"] == [False] and producer["ptx_has_kernel"]
    assert producer["remote"]["writes"] >= 7, producer  # each stage's file, the metadata and the group
    assert new["cache_hit"] == [True], new  # Triton compiled nothing
    assert new["cubin"] == producer["cubin"]
    assert new["remote"]["hits"] >= 7 and new["remote"]["writes"] == 0 and new["remote"]["rejected"] == 0, new


def test_a_store_that_raises_costs_sharing_never_the_compile(machine, monkeypatch):
    """A fault in warmstart's own store code (injected: every get and put raises) leaves Triton's
    compile working from local files: the kernel is written, found again locally, and nothing raises."""

    def broken(*args, **kwargs):
        raise RuntimeError("injected store fault")

    machine("a")
    monkeypatch.setattr(TieredStore, "get", broken)
    monkeypatch.setattr(TieredStore, "put", broken)
    m = WarmstartCacheManager("KBROKEN")
    group = compile_as_triton_does(m, b"\x7fELF")
    assert WarmstartCacheManager("KBROKEN").get_group("k.json") == group  # the local files serve the next compile
    assert m.get_file("absent.cubin") is None
