"""The local tier runs what its directory holds: a directory someone else could write is refused
(one warning, local tier off) unless it is shared on purpose (``WARMSTART_CACHE_DIR_SHARED=1``)."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from warmstart.compile_cache import open_store
from warmstart.config import Settings

OTHER_UID = 65534  # nobody


def _open(cache_dir, shared: bool = False):
    env = {"WARMSTART": "1", "WARMSTART_CACHE_DIR": str(cache_dir)}
    if shared:
        env["WARMSTART_CACHE_DIR_SHARED"] = "1"
    return open_store(Settings.from_env(env), persist_stats=False)


def _refusals(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "local cache tier off" in r.getMessage()
    ]


def test_a_directory_warmstart_creates_is_private(tmp_path):
    store = _open(tmp_path / "new" / "cache")
    assert store is not None and store.local is not None
    for path in (tmp_path / "new" / "cache", tmp_path / "new" / "cache" / "store"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    store.put("fx_graph", "k", b"v")
    assert store.get("fx_graph", "k").value == b"v"


@pytest.mark.parametrize("where", ["dir", "store"])
def test_a_directory_others_can_write_is_refused(tmp_path, caplog, where):
    cache_dir = tmp_path / "cache"
    (cache_dir / "store").mkdir(parents=True)
    (cache_dir if where == "dir" else cache_dir / "store").chmod(0o777)
    assert _open(cache_dir) is None  # local only, and refused: no store
    assert _open(cache_dir) is None
    lines = _refusals(caplog)
    assert len(lines) == 1 and "writable by group or others" in lines[0] and "WARMSTART_CACHE_DIR_SHARED=1" in lines[0]
    assert not (cache_dir / "store" / "cache.db").exists()  # not even opened


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_another_user_owns_is_refused(tmp_path, caplog):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o755)
    os.chown(cache_dir, OTHER_UID, OTHER_UID)
    assert _open(cache_dir) is None
    lines = _refusals(caplog)
    assert len(lines) == 1 and f"owned by uid {OTHER_UID}" in lines[0]


@pytest.mark.parametrize("fault", ["mode", "owner"])
def test_a_directory_shared_on_purpose_is_used(tmp_path, caplog, fault):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    if fault == "mode":
        cache_dir.chmod(0o777)
    elif os.geteuid() == 0:
        os.chown(cache_dir, OTHER_UID, OTHER_UID)
    else:
        pytest.skip("giving a directory to another user needs root")
    store = _open(cache_dir, shared=True)
    assert store is not None and store.local is not None
    store.put("fx_graph", "k", b"shared")
    assert _open(cache_dir, shared=True).get("fx_graph", "k").value == b"shared"
    assert _refusals(caplog) == []


def test_a_refused_directory_still_leaves_the_remote_tier(redis_node, tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    env = {
        "WARMSTART": "1",
        "WARMSTART_CACHE_DIR": str(cache_dir),
        "WARMSTART_CACHE_URL": redis_node.url,
        "WARMSTART_SECRET": "s",
    }
    store = open_store(Settings.from_env(env))
    assert store.local is None and store.remote is not None
    assert store.stats_file is None  # nothing is written into a directory others control
    store.put("fx_graph", "k", b"remote", sync=True)
    assert store.get("fx_graph", "k").value == b"remote"
    store.close()
    assert not (cache_dir / "stats.json").exists()


def test_namespaces_sharing_a_directory_never_read_each_others_entries(tmp_path):
    """An NFS home shared by machines of other CPUs, or jobs of another WARMSTART_NAMESPACE: one local
    directory, and each namespace sees its own entries only."""
    from warmstart.compile_cache import open_store
    from warmstart.config import Settings

    def store(namespace: str):
        return open_store(
            Settings.from_env(
                {"WARMSTART": "1", "WARMSTART_CACHE_DIR": str(tmp_path / "cache"), "WARMSTART_NAMESPACE": namespace}
            ),
            persist_stats=False,
        )

    team_a, team_b = store("team-a"), store("team-b")
    try:
        team_a.put("fx_graph", "same-key", b"team a's graph", sync=True)
        assert team_b.get("fx_graph", "same-key").value is None
        assert team_a.get("fx_graph", "same-key").value == b"team a's graph"
        team_b.put("fx_graph", "same-key", b"team b's graph", sync=True)
        assert team_a.get("fx_graph", "same-key").value == b"team a's graph"
        assert team_b.get("fx_graph", "same-key").value == b"team b's graph"
    finally:
        team_a.close()
        team_b.close()
