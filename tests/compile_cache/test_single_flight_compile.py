"""Single-flight with real ``torch.compile`` jobs on brand-new "machines" sharing one real redis-server:
two jobs compiling the same model at once compile it once; a holder killed with SIGKILL mid-compile, or
whose compile raises, is taken over by the job waiting for it, which finishes on its own.

A holder is made slow or failing with a ``g++`` placed first on its ``PATH`` (Inductor runs the
compiler by name, so the cache keys stay those of the real one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from _machine import machine_env
from _wait import until

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "benchmarks" / "compile_job.py"
SECRET = "single-flight-secret"
#: Hang guard for two small compiles on 2 cores, one after the other: not a speed check.
HANG_GUARD_S = 300

pytestmark = [pytest.mark.slow, pytest.mark.timeout(HANG_GUARD_S)]


def _start(
    machine: Path, url: str, *, compiler_dir: Path | None = None, model: str = "tiny", key_file: Path | None = None
) -> subprocess.Popen:
    env = machine_env(
        machine, TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0", WARMSTART_CACHE_URL=url, WARMSTART_SECRET=SECRET
    )
    if compiler_dir is not None:
        env["PATH"] = f"{compiler_dir}{os.pathsep}{env['PATH']}"
    if key_file is not None:
        del env["WARMSTART_SECRET"]
        env["WARMSTART_KEY_FILE"] = str(key_file)
    return subprocess.Popen(
        [sys.executable, str(JOB), "--model", model],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])


def _compiler(tmp_path: Path, *, fail: bool) -> tuple[Path, Path]:
    """A directory whose ``g++`` holds Inductor's kernel builds (``*.main.cpp``; not the vector-ISA
    probes or ``--version``) until the returned file exists, then builds with the real compiler, or
    fails. (The file never appearing is a hang guard's business, at HANG_GUARD_S.)"""
    directory = tmp_path / "compiler"
    directory.mkdir()
    release = tmp_path / "release-the-compiler"
    real = "/usr/bin/g++"
    action = 'echo "injected compiler failure" >&2; exit 1' if fail else f'exec {real} "$@"'
    hold = f'while [ ! -e "{release}" ]; do sleep 0.1; done'
    (directory / "g++").write_text(
        f'#!/bin/sh\ncase " $* " in *".main.cpp "*) {hold}; {action};; esac\nexec {real} "$@"\n'
    )
    (directory / "g++").chmod(0o755)
    return directory, release


def _aot_lease(url: str) -> bool:
    return any(True for _ in redis.Redis.from_url(url).scan_iter(match="ws:*:l:aot_autograd:*"))


def _waiting(machine: Path) -> bool:
    # A job that misses an entry another machine is compiling holds its own host's lock file while
    # it waits for the other machine's lease.
    return any((machine / "warmstart" / "leases").glob("*.lock"))


def test_two_machines_compiling_one_model_at_once_compile_it_once(redis_node, tmp_path):
    procs = [_start(tmp_path / f"m{i}", redis_node.url) for i in range(2)]
    results = [_result(p) for p in procs]
    assert results[0]["losses"] == results[1]["losses"]
    counters = [r["counters"] for r in results]
    waiter = next(r for r in results if r["counters"].get("waits"))
    holder = next(r for r in results if r is not waiter)
    assert holder["counters"]["leases"] >= 1 and not holder["counters"].get("waits"), counters
    assert not waiter["counters"].get("takeovers"), counters
    # The waiter loaded what the holder compiled: its graphs and objects came from the shared tier.
    assert waiter["store"]["remote"]["aot_autograd"]["hits"] >= 1
    assert waiter["store"]["remote"].get("cpp_object", {}).get("misses", 0) == 0
    assert waiter["aot_autograd"].get("autograd_cache_hit", 0) == 1


def test_the_aot_autograd_lease_lasts_through_a_slow_lazy_backward(tmp_path):
    """AOTAutograd saves its entry when it lowers the backward, at the first backward pass: a lowering
    that takes longer than the lease is kept after the forward's compile must not lose the lease
    (waiters would take over and trace the joint graph again), and the save releases it."""
    env = machine_env(tmp_path / "m", TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "compile_cache" / "_lazy_backward_job.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    assert seen["aot_leases_after_forward"] == 1 and seen["aot_leases_in_backward"] == 1, seen
    assert seen["aot_autograd"].get("autograd_cache_saved") == 1, seen
    assert seen["held_after"] == 0 and "leases_lapsed" not in seen["counters"], seen


def test_a_holder_killed_mid_compile_is_taken_over(redis_node, tmp_path):
    compiler, _ = _compiler(tmp_path, fail=False)  # never released: the holder is killed while it compiles
    holder = _start(tmp_path / "holder", redis_node.url, compiler_dir=compiler)
    try:
        until(lambda: _aot_lease(redis_node.url), timeout=120.0, poll_s=0.1)
        waiter = _start(tmp_path / "waiter", redis_node.url)
        until(lambda: _waiting(tmp_path / "waiter"), timeout=120.0, poll_s=0.1)
        time.sleep(1.0)
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        result = _result(waiter)
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
    assert result["counters"]["waits"] >= 1 and result["counters"]["takeovers"] >= 1
    assert result["counters"].get("wait_timeouts", 0) == 0  # it ended because the lease lapsed
    assert result["aot_autograd"]["autograd_cache_saved"] >= 1  # it compiled itself


def test_a_holder_whose_compile_raises_releases_its_leases(redis_node, tmp_path):
    compiler, release = _compiler(tmp_path, fail=True)
    holder = _start(tmp_path / "holder", redis_node.url, compiler_dir=compiler)
    until(lambda: _aot_lease(redis_node.url), timeout=120.0, poll_s=0.1)
    waiter = _start(tmp_path / "waiter", redis_node.url)
    until(lambda: _waiting(tmp_path / "waiter"), timeout=120.0, poll_s=0.1)  # it waits on the holder's lease
    release.touch()  # ... and then the holder's compile fails
    _, err = holder.communicate(timeout=HANG_GUARD_S)
    assert holder.returncode != 0 and "injected compiler failure" in err
    result = _result(waiter)
    assert result["counters"]["takeovers"] >= 1 and result["counters"].get("wait_timeouts", 0) == 0
    assert result["aot_autograd"]["autograd_cache_saved"] >= 1


def test_a_lease_planted_on_every_entry_costs_a_new_machine_nothing(redis_node, tmp_path):
    """With the writer's password alone (no signing key), someone unlinks every entry and sets a lease
    that never expires in its place. A new machine holding the public key must not wait on any of
    them: it compiles, within the time of a cold compile and a few seconds."""
    from warmstart.compile_cache.signing import generate_key_pair

    generate_key_pair(tmp_path / "signing.key", tmp_path / "verify.pub")
    start = time.monotonic()
    _result(_start(tmp_path / "producer", redis_node.url, key_file=tmp_path / "signing.key"))
    cold_s = time.monotonic() - start
    client = redis.Redis.from_url(redis_node.url)
    pointers = [name.decode() for name in client.scan_iter(match="ws:*:p:*")]
    assert pointers
    for name in pointers:
        prefix, _, rest = name.partition(":p:")
        client.unlink(name)
        client.set(f"{prefix}:l:{rest}", b"planted")  # no expiry
    start = time.monotonic()
    result = _result(_start(tmp_path / "new", redis_node.url, key_file=tmp_path / "verify.pub"))
    new_s = time.monotonic() - start
    assert not result["counters"].get("waits"), result["counters"]
    assert result["counters"].get("leases_ignored", 0) >= 1, result["counters"]
    assert new_s < cold_s + 15, (new_s, cold_s)  # a bound from the failure table, not a speed check
