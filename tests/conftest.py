"""Shared fixtures: real redis-server processes (single node and a 3-node Cluster) on free ports,
and a fresh "machine" (empty HOME, TMPDIR and cache directories) per test."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _redis import RedisCluster, RedisNode  # noqa: E402

if shutil.which("redis-server") is None:  # pragma: no cover - the Makefile installs it
    raise RuntimeError("redis-server not found: run `make test` (it installs Debian's redis-server)")


@pytest.fixture
def redis_node(tmp_path_factory):
    """A fresh single-node redis-server on a free port; stopped after the test."""
    node = RedisNode(tmp_path_factory.mktemp("redis")).start()
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A 3-master Redis Cluster shared by the session (tests use their own namespaces)."""
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"), size=3).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    """Environment of a brand-new machine: empty HOME, TMPDIR, Inductor, Triton and warmstart dirs."""
    env = {
        "HOME": tmp_path / "home",
        "TMPDIR": tmp_path / "tmp",
        "TORCHINDUCTOR_CACHE_DIR": tmp_path / "inductor",
        "TRITON_CACHE_DIR": tmp_path / "triton",
        "WARMSTART_CACHE_DIR": tmp_path / "warmstart",
        "WARMSTART_RUN_DIR": tmp_path / "runs",
    }
    for key, path in env.items():
        path.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(key, str(path))
    for key in list(os.environ):
        if key.startswith("WARMSTART") and key not in env:
            monkeypatch.delenv(key)
    return tmp_path
