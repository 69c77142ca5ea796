"""Background compiles (``WARMSTART_COMPILE=background``), with real compiles and real processes: the
job trains eagerly while a worker compiles, then runs compiled; the losses are eager's until the
switch and the compiled code's after it; a worker that dies, or code a worker cannot import, costs an
inline compile, never the job. Time bounds are hang guards only."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _machine import machine_env
from _wait import until

from warmstart.metrics import compute_runs

JOB = Path(__file__).with_name("_background_job.py")
HANG_GUARD_S = 400  # a cold compile of these models takes 10-25 s on 2 cores


def _env(machine: Path, **extra: str) -> dict[str, str]:
    # no precompiled header either (seconds per machine), and no preloader
    return machine_env(machine, TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0", WARMSTART_PRELOAD="0", **extra)


def _start(machine: Path, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(JOB), *args],
        env=_env(machine, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), err


def _run(machine: Path, *args: str, **extra: str) -> tuple[dict, str]:
    return _result(_start(machine, *args, **extra))


def _eager(tmp_path: Path, model: str, steps: int, *extra: str) -> list[float]:
    result, _ = _run(tmp_path / "eager", "--model", model, "--eager-only", "--steps", str(steps), *extra)
    return result["losses"]


def _assert_eager_then_compiled(result: dict, reference: list[float]) -> None:
    phases, losses = result["phases"], result["losses"]
    reference = reference[: len(losses)]
    first_compiled = phases.index("compiled")
    assert first_compiled > 0 and set(phases[:first_compiled]) == {"eager"}
    assert set(phases[first_compiled:]) == {"compiled"}
    # Before the switch the job ran the module itself: eager's losses, bit for bit.
    assert losses[:first_compiled] == reference[:first_compiled]
    # After it, the compiled code: the same to float rounding.
    for got, want in zip(losses[first_compiled:], reference[first_compiled:], strict=True):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["regional", "breaking"])  # a plain module: the test after this one
def test_the_job_trains_eagerly_then_runs_what_the_worker_compiled(tmp_path, model):
    result, err = _run(tmp_path / "job", "--model", model, WARMSTART_COMPILE="background")
    assert result["worker_pid"], err[-2000:]
    assert f"a compile worker (pid {result['worker_pid']})" in err
    assert "runs compiled from now on" in err
    _assert_eager_then_compiled(result, _eager(tmp_path, model, len(result["losses"])))
    # The worker recorded no ETT events (it is not the job's rank): every process that records starts
    # with its launch, and only the job's is there.
    events = [
        json.loads(line)
        for path in (tmp_path / "job" / "runs").rglob("events-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    launches = [e for e in events if e.get("span") == "process_launch" and e["event"] == "begin"]
    assert len(launches) <= 1, launches
    # The report says when the job switched: in the step that first ran compiled, after the eager ones.
    (run,) = compute_runs([tmp_path / "job" / "runs"])
    (switch,) = run.compile_switches
    first_compiled = result["phases"].index("compiled")
    assert (switch.rank, switch.switches, switch.during_step) == (0, 1, first_compiled)
    assert switch.eager_steps == first_compiled and switch.eager_step_s is not None


@pytest.mark.slow
@pytest.mark.parametrize(("model", "graphs"), [("net", 1), ("breaking", 2)])
def test_a_recompile_after_the_switch_runs_eagerly_while_a_worker_compiles_it(tmp_path, model, graphs):
    # With a graph break, the recompile of the function's start is stopped (nothing of the call has
    # run yet), and the one of its second half, further into the call, runs as torch runs it.
    result, err = _run(tmp_path / "job", "--model", model, "--new-shape-after", "2", WARMSTART_COMPILE="background")
    phases, losses, at = result["phases"], result["losses"], result["new_shape_at"]
    # Eager, compiled; on the new shape eager again while a second worker compiles it, then compiled.
    first = phases.index("compiled")
    assert first > 0 and set(phases[:first]) == {"eager"} and set(phases[first:at]) == {"compiled"}, phases
    again = phases.index("compiled", at)
    assert again > at and set(phases[at:again]) == {"eager"} and set(phases[again:]) == {"compiled"}, phases
    assert result["recompiles"] == 1 and "recompiles from what its worker stored" in err, err[-2000:]
    # The job compiled both graphs (the first and the recompile), and each came from the store its
    # workers filled: none was compiled in the job, and none was left to run eagerly for good.
    assert result["graphs"] == 2 * graphs and result["autograd_hits"] == 2 * graphs, result
    assert result["autograd_misses"] == 0 and result["fx_graph_misses"] == 0, result
    reference = _eager(tmp_path, model, len(losses), "--new-shape-at", str(at))
    assert losses[:first] == reference[:first]
    for got, want in zip(losses[first:], reference[first:], strict=True):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6), (got, want)
    # Two switches on rank 0 in the report: the first compile and the recompile.
    (run,) = compute_runs([tmp_path / "job" / "runs"])
    (switch,) = run.compile_switches
    assert switch.switches == 2 and switch.during_step == first and switch.eager_steps == first


@pytest.mark.slow
def test_a_killed_worker_costs_an_inline_compile_at_the_next_call(tmp_path):
    # A function compiled on its own (the other tests compile modules).
    result, err = _run(tmp_path / "job", "--model", "function", "--kill-worker", WARMSTART_COMPILE="background")
    pid = result["worker_pid"]
    assert f"compiles inline: its compile worker (pid {pid}) ended with status -9" in err, err[-2000:]
    phases, losses = result["phases"], result["losses"]
    switched = phases.index("inline")
    assert set(phases[:switched]) == {"eager"} and set(phases[switched:]) == {"inline"}
    reference = _eager(tmp_path, "function", len(losses))
    assert losses[:switched] == reference[:switched]
    for got, want in zip(losses[switched:], reference[switched:], strict=True):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6), (got, want)


def test_a_worker_ends_with_its_job(tmp_path):
    job = _start(tmp_path / "job", "--model", "net", "--exit-after-first-step", WARMSTART_COMPILE="background")
    out, err = job.communicate(timeout=HANG_GUARD_S)
    pid = int(next(line for line in out.splitlines() if line.startswith("WORKER ")).split()[1])
    # Hang guard only: the worker checks every 0.5 s.
    until(lambda: not _alive(pid), timeout=30)
    # It ended because its job had, not because it was done: it never finished its compile.
    assert list((tmp_path / "job" / "warmstart" / "background").glob("*.done")) == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_processes_of_one_host_start_one_worker_and_all_switch(tmp_path):
    shared = {"WARMSTART_CACHE_DIR": str(tmp_path / "shared-cache"), "WARMSTART_COMPILE": "background"}
    jobs = [_start(tmp_path / f"rank{i}", "--model", "net", **shared) for i in range(2)]
    results = [_result(job) for job in jobs]
    started = [r for r, _ in results if r["worker_pid"]]
    assert len(started) == 1, [err[-1500:] for _, err in results]
    waited = next(err for r, err in results if not r["worker_pid"])
    assert "while another process's worker compiles it" in waited
    reference = _eager(tmp_path, "net", max(len(r["losses"]) for r, _ in results))
    for result, _ in results:
        _assert_eager_then_compiled(result, reference)


@pytest.mark.slow
def test_a_new_machine_whose_store_holds_the_compile_runs_compiled_from_its_first_call(tmp_path, redis_node):
    shared = {"WARMSTART_CACHE_URL": redis_node.url, "WARMSTART_SECRET": "s3cret", "WARMSTART_COMPILE": "background"}
    first, err = _run(tmp_path / "first", "--model", "net", **shared)
    assert first["worker_pid"] and "runs compiled from now on" in err
    _assert_eager_then_compiled(first, _eager(tmp_path, "net", len(first["losses"])))
    again, err = _run(tmp_path / "second", "--model", "net", **shared)
    assert again["worker_pid"] is None and set(again["phases"]) == {"compiled"}, err[-2000:]
    assert "runs compiled from now on (after 0 eager calls" in err
    reference = _eager(tmp_path, "net", len(again["losses"]))
    for got, want in zip(again["losses"], reference, strict=True):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6), (got, want)


def test_code_a_worker_cannot_import_compiles_inline(tmp_path):
    result, err = _run(tmp_path / "job", "--model", "main", "--compiled-steps", "1", WARMSTART_COMPILE="background")
    assert result["phases"] == ["inline"] and result["worker_pid"] is None
    assert "MainNet compiles inline: defined in __main__ (a worker cannot import it)" in err


def test_a_value_of_warmstart_compile_that_is_not_accepted_says_what_is():
    from warmstart.compile_cache.background import mode
    from warmstart.config import ConfigError

    assert mode({}) == "inline" and mode({"WARMSTART_COMPILE": " Background "}) == "background"
    assert mode({"WARMSTART_COMPILE": "background", "WARMSTART_COMPILE_WORKER": "1"}) == "inline"
    with pytest.raises(ConfigError, match="WARMSTART_COMPILE.*sometimes.*inline or background"):
        mode({"WARMSTART_COMPILE": "sometimes"})


def test_a_worker_another_process_started_in_the_meantime_is_awaited_and_said(tmp_path, caplog):
    """Two processes miss at once: the other one takes the worker's lock between this one's look at
    it and its own attempt. This one starts no worker, waits for that one's, and says so."""
    import fcntl
    import logging
    import os

    import torch

    from warmstart.compile_cache.background import Background

    job = Background("Net", torch.nn.Linear(2, 2), {}, eager=None, compiled=None)
    job._dir, job._key = tmp_path, "entry"
    other = os.open(tmp_path / "entry.lock", os.O_RDWR | os.O_CREAT, 0o600)  # the other process's
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with caplog.at_level(logging.INFO, logger="warmstart.cache"):
            assert job._launch() is None and job.worker_pid is None
            assert job._launch() is None  # polled again: said once
    finally:
        os.close(other)
    assert caplog.text.count("Net runs eagerly while another process's worker compiles it") == 1
