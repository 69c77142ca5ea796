"""`warmstart cache explain`: each miss of a job named with its reason, against a real redis-server.

Two "machines" share one server: the first fills it, the second (which differs in one thing) misses,
and explain must say why: another namespace (and which component), another key, or evicted blobs.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from _redis import RedisNode
from click.testing import CliRunner

from warmstart.cli import cli
from warmstart.compile_cache import open_store
from warmstart.compile_cache.explain import explain
from warmstart.compile_cache.miss_log import read_misses
from warmstart.compile_cache.storage import (
    ABSENT,
    BREAKER_OPEN,
    ERROR,
    EVICTED,
    OTHER_KEY_ID,
    OTHER_NAMESPACE,
    SKIPPED,
    TIMEOUT,
)
from warmstart.config import Settings

KEYS = [f"graph-{i}" for i in range(5)]


def _env(url: str, cache_dir, *, secret: str = "team-secret", namespace: str = "") -> dict[str, str]:
    env = {
        "WARMSTART": "1",
        "WARMSTART_CACHE_URL": url,
        "WARMSTART_SECRET": secret,
        "WARMSTART_CACHE_DIR": str(cache_dir),
    }
    if namespace:
        env["WARMSTART_NAMESPACE"] = namespace
    return env


def _fill(env: dict[str, str], values: dict[str, bytes]) -> None:
    store = open_store(Settings.from_env(env), persist_stats=False)
    for key, value in values.items():
        assert store.put("fx_graph", key, value, sync=True)
    store.close()


def _second_machine(env: dict[str, str], run_dir, monkeypatch, *, all_miss: bool = True) -> Settings:
    """Look every key up on a machine with its own cache dir, logging misses in ``run_dir``."""
    monkeypatch.setenv("WARMSTART_RUN_DIR", str(run_dir))
    settings = Settings.from_env(env)
    store = open_store(settings)
    results = [store.get("fx_graph", key) for key in KEYS]
    store.close()
    assert not any(results) or not all_miss
    return settings


def test_other_namespace_names_the_one_component_that_differs(redis_node, tmp_path, monkeypatch):
    _fill(_env(redis_node.url, tmp_path / "a", namespace="team-a"), {k: os.urandom(2000) for k in KEYS})
    settings = _second_machine(_env(redis_node.url, tmp_path / "b", namespace="team-b"), tmp_path / "run", monkeypatch)
    assert {m["reason"] for m in read_misses(tmp_path / "run")} == {ABSENT}  # what the job itself saw

    result = explain(settings, tmp_path / "run")
    assert result.reasons == {OTHER_NAMESPACE: len(KEYS)}
    assert result.namespace_diff == ["user"]
    assert any(line.startswith("user: WARMSTART_NAMESPACE differs") for line in result.advice())
    other = result.others[0]
    assert other["differs"] == {"user": ["team-b", "team-a"]}


def test_other_secret_is_other_key_id(redis_node, tmp_path, monkeypatch):
    _fill(_env(redis_node.url, tmp_path / "a", secret="writers-secret"), {k: os.urandom(2000) for k in KEYS})
    settings = _second_machine(
        _env(redis_node.url, tmp_path / "b", secret="another-secret"), tmp_path / "run", monkeypatch
    )
    result = explain(settings, tmp_path / "run")
    assert result.reasons == {OTHER_KEY_ID: len(KEYS)}
    assert result.namespace_diff == []  # same machine, same namespace: only the key differs
    assert any(line.startswith("other_key_id") for line in result.advice())


@pytest.fixture
def small_server(tmp_path_factory):
    """A redis-server that evicts least recently used keys past 3 MB, as a full cache server does."""
    node = RedisNode(
        tmp_path_factory.mktemp("small"),
        extra=["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10"],
    ).start()
    yield node
    node.stop()


def test_evicted_blobs(small_server, tmp_path, monkeypatch):
    import redis

    env = _env(small_server.url, tmp_path / "a")
    _fill(env, {k: os.urandom(200_000) for k in KEYS})  # chunked: pointer plus blob
    client = redis.Redis.from_url(small_server.url)
    pointers = [k for k in client.scan_iter(match="ws:*:p:*")]
    time.sleep(1.1)  # Redis's LRU clock ticks once a second: the reads below must come a tick later
    for i in range(100):  # another workload fills the server until LRU eviction starts
        for name in pointers:  # the records are read meanwhile: their blobs are the least recently used keys
            client.get(name)
        client.set(f"ws:filler:{i}", os.urandom(100_000))
        if int(client.info("stats")["evicted_keys"]) >= 2:
            break
    assert int(client.info("stats")["evicted_keys"]) >= 2
    assert all(client.exists(name) for name in pointers)

    settings = _second_machine(
        _env(small_server.url, tmp_path / "b"), tmp_path / "run", monkeypatch, all_miss=False
    )  # entries whose blob survived are hits
    result = explain(settings, tmp_path / "run")
    assert result.reasons.get(EVICTED, 0) >= 1, result.reasons
    assert set(result.reasons) <= {EVICTED, ABSENT}
    assert any("--maxmemory" in line for line in result.advice())


def test_cli_json_and_last_job(redis_node, tmp_path, monkeypatch):
    _fill(_env(redis_node.url, tmp_path / "a", namespace="team-a"), {k: b"v" * 100 for k in KEYS})
    env = _env(redis_node.url, tmp_path / "b", namespace="team-b")
    _second_machine(env, tmp_path / "run", monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = CliRunner().invoke(cli, ["cache", "explain", "--json"])  # no RUN_DIR: the last job of this cache dir
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["reasons"] == {OTHER_NAMESPACE: len(KEYS)}
    assert data["namespace_diff"] == ["user"]
    assert {m["kind"] for m in data["misses"]} == {"fx_graph"} and len(data["misses"]) == len(KEYS)
    assert {"kind", "key", "reason"} <= set(data["misses"][0])
    human = CliRunner().invoke(cli, ["cache", "explain", str(tmp_path / "run")])
    assert human.exit_code == 0 and "other_namespace" in human.output and "user" in human.output


def test_no_misses_is_an_answer(tmp_path, monkeypatch):
    """After a job whose every lookup hit (or before any job), there is nothing to explain."""
    monkeypatch.setenv("WARMSTART_CACHE_DIR", str(tmp_path / "empty"))
    out = CliRunner().invoke(cli, ["cache", "explain"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("no misses: no job has logged a cache miss in") and "Usage" not in out.output
    # A job served by torch's own cache on the machine never asks warmstart: the answer says so.
    assert "came from torch's own cache on this machine, TORCHINDUCTOR_CACHE_DIR" in " ".join(out.output.split())
    data = json.loads(CliRunner().invoke(cli, ["cache", "explain", "--json"]).stdout)
    assert (data["reasons"], data["misses"], data["namespace_diff"], data["run_dir"]) == ({}, [], [], None)
    assert data["namespace"]["id"] and data["server"] == "not asked: no misses to explain"


@pytest.fixture
def old_acl_server(tmp_path_factory):
    """A server whose writer may not touch the registry (an ACL from before it existed)."""
    node = RedisNode(
        tmp_path_factory.mktemp("old-acl"),
        extra=[
            "--user",
            "default",
            "off",
            "--user",
            "writer",
            "on",
            ">pw",
            "~ws:*",
            "+@all",
            "-hset",
            "-hdel",
            "-hlen",
            "-hkeys",
            "-hgetall",
        ],
    ).start()
    yield node
    node.stop()


def test_a_server_without_the_registry_costs_the_explanation_never_the_job(old_acl_server, tmp_path, monkeypatch):
    url = f"redis://writer:pw@127.0.0.1:{old_acl_server.port}/0"
    _fill(_env(url, tmp_path / "a", namespace="team-a"), {k: b"v" * 3000 for k in KEYS})  # writes despite NOPERM
    store = open_store(Settings.from_env(_env(url, tmp_path / "c", namespace="team-a")), persist_stats=False)
    assert all(store.get("fx_graph", k).value == b"v" * 3000 for k in KEYS)
    store.close()
    settings = _second_machine(_env(url, tmp_path / "b", namespace="team-b"), tmp_path / "run", monkeypatch)
    result = explain(settings, tmp_path / "run")
    assert result.reasons == {ABSENT: len(KEYS)}  # what the job saw: the server could not say more
    assert "could not be asked" in result.server and "pw" not in result.server


def test_a_tier_that_was_off_timed_out_or_failed_is_named_for_each_cause(redis_node, tmp_path, monkeypatch):
    """A dead server (a refused connection: an error, then the breaker) and a stopped one (a lookup
    that waits out its deadline: a timeout, then the breaker) in one job's log: each cause gets its
    own count and its own sentence, and ``skipped`` in JSON stays their sum."""
    import signal

    from _redis import closed_port_url

    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path / "run"))
    dead = Settings.from_env(_env(closed_port_url(), tmp_path / "dead"))
    store = open_store(dead)
    assert [store.get("fx_graph", k).reason for k in KEYS[:3]] == [ERROR, BREAKER_OPEN, BREAKER_OPEN]
    store.close()
    os.kill(redis_node.proc.pid, signal.SIGSTOP)
    try:
        store = open_store(Settings.from_env(_env(redis_node.url, tmp_path / "stopped")))
        assert [store.get("fx_graph", k).reason for k in KEYS[:2]] == [TIMEOUT, BREAKER_OPEN]
        store.close()
    finally:
        os.kill(redis_node.proc.pid, signal.SIGCONT)

    result = explain(dead, tmp_path / "run")
    assert result.reasons == {BREAKER_OPEN: 3, TIMEOUT: 1, ERROR: 1, SKIPPED: 5}
    assert result.by_kind() == {"fx_graph": result.reasons}
    sentences = {line.split(":", 1)[0]: line for line in result.advice()}
    assert set(sentences) == {"breaker_open (3)", "timeout (1)", "error (1)"}
    assert len({line.split(": ", 1)[1] for line in sentences.values()}) == 3  # three different sentences

    for name, value in _env(closed_port_url(), tmp_path / "dead").items():
        monkeypatch.setenv(name, value)
    out = CliRunner().invoke(cli, ["cache", "explain", "--json", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["reasons"] == {"breaker_open": 3, "timeout": 1, "error": 1, "skipped": 5}
    assert {m["reason"] for m in data["misses"]} == {"breaker_open", "timeout", "error"}
    human = CliRunner().invoke(cli, ["cache", "explain", str(tmp_path / "run")])
    assert human.exit_code == 0, human.output
    assert all(word in human.output for word in ("breaker_open", "timeout", "error"))
    assert "skipped" not in human.output  # a sum, not a cause


def test_a_log_from_before_the_split_still_reads_as_skipped(tmp_path):
    """Miss logs written before ``skipped`` was split keep their reason, counted and advised on."""
    from warmstart.compile_cache.miss_log import MISSES_DIR

    logs = tmp_path / "run" / MISSES_DIR
    logs.mkdir(parents=True)
    lines = [{"ts": 1.0, "kind": "fx_graph", "key": "a", "reason": "skipped", "tier": "remote"}]
    lines.append({"ts": 2.0, "kind": "fx_graph", "key": "b", "reason": "timeout", "tier": "remote"})
    (logs / "host-1.ndjson").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = explain(Settings(enabled=True, cache_dir=tmp_path / "cache"), tmp_path / "run")
    assert result.reasons == {TIMEOUT: 1, SKIPPED: 2}
    assert result.columns() == [TIMEOUT, SKIPPED]
    assert [line.split(":", 1)[0] for line in result.advice()] == ["timeout (1)", "skipped (1)"]


def test_an_entry_every_job_misses_is_told_from_a_first_miss(redis_node, tmp_path, monkeypatch):
    """Four identical jobs, each missing the same entries that nothing stores (a forward-only
    script's AOTAutograd backward): the fourth job's misses are not "expected on a first start"."""
    env = _env(redis_node.url, tmp_path / "cache")
    for job in range(4):
        settings = _second_machine(env, tmp_path / f"job-{job}", monkeypatch)
        time.sleep(0.01)  # each job's misses after the previous job's
    first = explain(settings, tmp_path / "job-0")
    assert first.reasons == {ABSENT: len(KEYS)} and not any(m.get("earlier") for m in first.misses)
    assert any("expected on a first start" in line for line in first.advice())
    fourth = explain(settings, tmp_path / "job-3")
    assert fourth.reasons == {ABSENT: len(KEYS)}  # the reason keeps its name in --json
    assert [m["detail"] for m in fourth.misses] == ["missed in 3 earlier jobs of this cache too: never stored"] * 5
    advice = fourth.advice()
    assert not any("expected on a first start" in line for line in advice), advice
    assert any(line.startswith(f"absent, every time ({len(KEYS)}): ") and "first backward" in line for line in advice)
    # A key stored in between hits afterwards: only what still misses is marked.
    _fill(env, {KEYS[0]: b"now stored"})
    _second_machine(env, tmp_path / "job-4", monkeypatch, all_miss=False)
    fifth = explain(settings, tmp_path / "job-4")
    assert len(fifth.misses) == len(KEYS) - 1 and all(m["earlier"] == 4 for m in fifth.misses)
