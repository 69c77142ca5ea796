"""How the benchmark behaves when a job goes wrong: a caller's long TMPDIR (DataLoader workers' AF_UNIX
sockets) and a configuration that stops making progress (the watchdog). Real processes, no test hooks
in the job."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _redis import require_redis_server

from warmstart.bench import supervise
from warmstart.bench.cold_vs_warm import BenchError, BenchOptions, run_cold_vs_warm
from warmstart.bench.config import JobConfig
from warmstart.bench.supervise import launcher_args, short_tmp_root
from warmstart.compile_cache.doctor_checks import AF_UNIX_PATH_MAX, longest_socket_path


@pytest.fixture
def long_tmpdir(tmp_path_factory, monkeypatch):
    """A caller TMPDIR of >= 90 characters, as a scheduler may set one (too long for the sockets)."""
    base = tmp_path_factory.mktemp("caller")
    path = base / ("tmp-with-a-rather-long-scheduler-given-name-" + "x" * max(1, 90 - len(str(base))))
    path.mkdir()
    assert len(str(path)) >= 90 and longest_socket_path(path) > AF_UNIX_PATH_MAX
    monkeypatch.setenv("TMPDIR", str(path))
    return path


def test_machines_get_a_short_tmpdir_under_a_long_caller_tmpdir(long_tmpdir):
    root = short_tmp_root()
    try:
        assert root.is_dir() and not any(root.iterdir())
        assert not str(root).startswith(str(long_tmpdir))  # fell back to /tmp (or /dev/shm)
        assert longest_socket_path(root / "attempt-99") <= AF_UNIX_PATH_MAX
    finally:
        root.rmdir()


def test_short_caller_tmpdir_is_kept(monkeypatch):
    caller = Path(os.path.realpath("/tmp")) / f"ws-test-{os.getpid()}"
    caller.mkdir()
    monkeypatch.setenv("TMPDIR", str(caller))
    try:
        root = short_tmp_root()
        assert root.parent == caller
        root.rmdir()
    finally:
        caller.rmdir()


_LOADER = """
import tempfile, time
from warmstart.bench.data import ClickLogDataset, make_loader, make_tables
loader = make_loader(ClickLogDataset(make_tables(8, rows_min=100, rows_max=2000), 64, rank=0), num_workers=2)
batches = iter(loader)
for _ in range(6):
    next(batches)
print("loaded 6 batches; TMPDIR", tempfile.gettempdir(), flush=True)
"""


def test_reference_job_loader_completes_on_a_bench_machine_under_a_long_caller_tmpdir(long_tmpdir, tmp_path):
    # The bench's own launcher, as torchrun runs it for a rank, with the caller's long TMPDIR in the
    # environment: the reference job's loader (worker processes, tensors over AF_UNIX) must deliver.
    # Before the fix the machine's TMPDIR was nested under the work dir and this hung forever.
    root = short_tmp_root()
    try:
        env = {**os.environ, "TORCHELASTIC_RESTART_COUNT": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [*launcher_args(tmp_path / "machines", root), "-c", _LOADER],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"TMPDIR {root}/attempt-1" in done.stdout
        assert "AF_UNIX path too long" not in done.stderr
        assert sorted(p.name for p in (tmp_path / "machines" / "attempt-1").iterdir()) == [
            "home",
            "inductor",
            "triton",
            "warmstart-cache",
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _pids_of(run_dir: Path) -> dict[int, str]:
    """Processes (ranks, their loader workers) whose environment names this run directory: pid -> RANK."""
    found = {}
    needle = f"WARMSTART_RUN_DIR={run_dir}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if needle in env:
            rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), "")
            found[int(entry.name)] = rank
    return found


@pytest.mark.slow
def test_watchdog_dumps_the_stacks_and_names_the_stalled_stage(tmp_path):
    require_redis_server()  # the bench starts its own cache server
    # A real stall: rank 1 is stopped (SIGSTOP) as soon as it recorded its attempt_start, so rank 0
    # waits for it forever at the first collective and no ETT event comes any more.
    work = tmp_path / "work"
    run_dir = (work / "baseline" / "runs").resolve()
    options = BenchOptions(
        job=JobConfig(steps=10, tables=4, batch_size=32, checkpoint_every=3, fail_at_step=7),
        work_dir=work,
        timeout_s=300,
        stall_timeout_s=8,
    )
    stopped: list[int] = []

    def stop_rank_1() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not stopped:
            if (run_dir / "events-r1-a0.jsonl").exists():
                for pid, rank in _pids_of(run_dir).items():
                    if rank == "1":
                        os.kill(pid, signal.SIGSTOP)
                        stopped.append(pid)
                        break
            time.sleep(0.1)

    thread = threading.Thread(target=stop_rank_1, daemon=True)
    thread.start()
    with pytest.raises(BenchError) as caught:  # the bench's own timeout_s is the hang guard
        run_cold_vs_warm(options)
    thread.join(timeout=5)
    assert stopped, "rank 1 was never seen"
    message = str(caught.value)
    log = work / "baseline" / "job.log"
    assert "\n" not in message
    assert re.fullmatch(
        r"baseline: attempt 0 recorded no ETT event for 8 s \(last stage: rank 0 .+, rank 1 .+\); "
        r"dumped every rank's Python stacks into the log and stopped it \(log: .+\)",
        message,
    ), message
    assert message.endswith(f"(log: {log.resolve()})")
    text = log.read_text(errors="replace")
    # faulthandler's dump of both ranks (the stopped one was continued to dump)
    assert text.count("Thread 0x") >= 2 and 'File "' in text and "(most recent call first)" in text
    time.sleep(0.5)
    assert _pids_of(run_dir) == {}, "processes of the stalled configuration are still alive"
    assert not (work / "cold").exists()  # the bench stopped at the first failed configuration


def test_last_stage_names_each_rank_of_the_attempt(tmp_path):
    from warmstart.metrics.events import write_events

    write_events(
        tmp_path / "events-r0-a1.jsonl",
        [
            {"ts": 1.0, "job": "j", "attempt": 1, "rank": 0, "event": "attempt_start"},
            {"ts": 2.0, "job": "j", "attempt": 1, "rank": 0, "event": "begin", "span": "data_loader_init"},
        ],
    )
    write_events(
        tmp_path / "events-r1-a0.jsonl", [{"ts": 1.0, "job": "j", "attempt": 0, "rank": 1, "event": "step", "step": 4}]
    )
    (tmp_path / "events-r1-a1.jsonl").write_text(
        '{"ts": 1.5, "job": "j", "attempt": 1, "rank": 1, "event": "end", '
        '"span": "process_group_init"}\n{"ts": 1.6, "jo'
    )
    assert supervise._last_stages(tmp_path, 2, None) == (
        1,
        "rank 0 in data_loader_init, rank 1 after process_group_init",
    )
    assert supervise._last_stages(tmp_path, 3, 0) == (
        0,
        "rank 0 no event yet, rank 1 in step 4, rank 2 no event yet",
    )


def test_a_stall_names_a_rank_that_could_not_write_its_events(tmp_path):
    # A rank whose event file cannot be written (here its run directory is a file; on a CI machine, a
    # full disk) goes on training with no record: the stall message says so, in the recorder's words.
    import logging

    from warmstart.metrics import Recorder

    log_path = tmp_path / "job.log"
    handler = logging.FileHandler(log_path)
    logger = logging.getLogger("warmstart.metrics")
    logger.addHandler(handler)
    try:
        (tmp_path / "runs").write_text("not a directory")
        rec = Recorder(tmp_path / "runs", job="j", rank=0, attempt=0, flush_interval_s=0)
        rec.attempt_start()
        rec.flush()
    finally:
        logger.removeHandler(handler)
        handler.close()
    said = supervise._unwritten_events(log_path)
    assert said.startswith("; a rank could not write its events (warmstart: cannot write ETT events to "), said
    assert supervise._unwritten_events(tmp_path / "no-such.log") == ""
