"""Shared fixtures: real redis-server processes (single node and a 3-node Cluster) and real
prometheus servers (``_prometheus.py``) on free ports,
a fresh "machine" (empty HOME, TMPDIR and cache directories) per test, and process-wide state
(the compile-cache store, the recorder, the warn-once causes) reset after every test.

The whole run is isolated from the user running it (``_isolation.py``): HOME, the XDG directories,
TMPDIR, torch's caches and pytest's base directory lie under one short root in /tmp, removed at the
end, so the suite never touches the user's own caches and socket paths fit whatever the user name.

Ports, nodes and clusters come from ``_redis.py``. A test that needs ``redis-server`` is skipped,
with the reason, where it is not installed (and fails under CI); every other test runs anyway."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Before anything reads HOME or TMPDIR: the run's own short root (see _isolation.py).
from _isolation import BASETEMP_VARIABLE, isolate_session, owns_root, run_root, short_tmpdir

isolate_session()

from _redis import RedisCluster, RedisNode, in_ci  # noqa: E402 (after the isolation above)

# A preloader the developer runs must not run the suite's programs: tests of the preloader start
# their own and say so in their processes' environment.
os.environ["WARMSTART_PRELOAD"] = "0"
from _prometheus import PrometheusServer  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config) -> None:
    """pytest's base directory under the run's short root (unless ``--basetemp`` is given): the
    default, ``/tmp/pytest-of-<user>/pytest-<n>/popen-gw<k>/<test>``, grows with the user name, and
    sockets under it can pass the 107-byte AF_UNIX limit. xdist's workers get ``<basetemp>/popen-gw<k>``."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = str(run_root() / "p")
        os.environ[BASETEMP_VARIABLE] = config.option.basetemp  # for xdist's workers, which it starts after


def pytest_unconfigure(config) -> None:
    if owns_root() and not hasattr(config, "workerinput"):
        shutil.rmtree(run_root(), ignore_errors=True)


def pytest_report_header(config) -> str:
    path = shutil.which("redis-server")
    if path is not None:
        return f"redis-server: {path}"
    return "redis-server: not found; tests that need it " + ("fail (CI is set)" if in_ci() else "are skipped")


@pytest.fixture(scope="session", autouse=True)
def _cwd_in_run_root():
    """The tests run in a directory of the run's root, so that what a job writes relative to its
    working directory (``./warmstart-runs/<job id>`` without ``WARMSTART_RUN_DIR``) stays out of the
    checkout. Set after collection: the command line's test paths are relative to where pytest started."""
    previous = os.getcwd()
    work = run_root() / "cwd"
    work.mkdir(exist_ok=True)
    os.chdir(work)
    yield
    os.chdir(previous)


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
def prometheus_server(tmp_path_factory):
    """Start a real ``prometheus`` scraping the given targets: ``prometheus_server(["127.0.0.1:PORT"],
    rule_files=[...])``; every one started is stopped after the test."""
    started: list[PrometheusServer] = []

    def start(targets: list[str], rule_files: list[Path] = ()) -> PrometheusServer:
        server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), list(targets), list(rule_files))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(autouse=True)
def _reset_process_state():
    """After each test, the process is as a new one would be: no process-wide store (closed first,
    if one was built), no process-wide recorder, no cause warned about yet.

    Only modules the test imported are touched: nothing is imported here (never torch)."""
    yield
    cache = sys.modules.get("warmstart.compile_cache")
    if cache is not None:
        store = cache._store if cache._store_loaded else None
        cache.reset_store()
        if store is not None:
            store.close()
    recorder = sys.modules.get("warmstart.metrics.recorder")
    if recorder is not None:
        recorder.reset_process_recorder()
    storage = sys.modules.get("warmstart.compile_cache.storage")
    if storage is not None:
        with storage._warned_lock:
            storage._warned.clear()


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    """Environment of a brand-new machine: empty HOME, TMPDIR, Inductor, Triton and warmstart dirs
    (TMPDIR short whatever the base directory, for the sockets made under it)."""
    env = {
        "HOME": tmp_path / "home",
        "TMPDIR": short_tmpdir(),
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
