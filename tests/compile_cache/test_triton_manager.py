"""The Triton cache manager's interface, on CPU, against a real store (local tier + real Redis)."""

from __future__ import annotations

import json
import os

import pytest

from warmstart.compile_cache import LocalTier, RemoteTier, TieredStore, set_store
from warmstart.compile_cache.triton_manager import CacheManager, WarmstartCacheManager


@pytest.fixture
def machine(tmp_path, monkeypatch, redis_node):
    """Return a function that makes a new "machine": fresh Triton dir and local tier, shared Redis."""

    def new(name: str) -> None:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / name / "triton"))
        set_store(TieredStore(LocalTier(tmp_path / name / "ws", 1 << 30),
                              RemoteTier(redis_node.url, secret=b"s", namespace="tri")))

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
    m.put_group("__grp__k.json", paths)
    from warmstart.compile_cache import get_store

    get_store().flush(timeout=10)

    machine("b")
    m2 = WarmstartCacheManager("KEYABC")
    assert m2.get_file("k.cubin") is None or True  # fetched lazily below
    group = m2.get_group("__grp__k.json")
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
    m.put_group("__grp__x.json", {"x.cubin": "/elsewhere/x.cubin"})
    from warmstart.compile_cache import get_store

    get_store().flush(timeout=10)
    machine("b")
    assert WarmstartCacheManager("K3").get_group("__grp__x.json") is None


def test_override_and_dump_managers_stay_local(machine, tmp_path, monkeypatch):
    machine("a")
    monkeypatch.setenv("TRITON_DUMP_DIR", str(tmp_path / "dump"))
    m = WarmstartCacheManager("K4", dump=True)
    m.put(b"ir", "k.ttir")
    from warmstart.compile_cache import get_store

    get_store().flush(timeout=10)
    assert m.cache_dir.startswith(str(tmp_path / "dump"))
    assert get_store().stats.get("remote", "triton_kernel").writes == 0
