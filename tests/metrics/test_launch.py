"""A process's launch and its imports are buckets of their own (docs/metrics.md#how-wall-time-is-split):
hand-made timelines with hand-computed buckets, the recorder's ``process_launch`` span, and a real
job process whose report shows both buckets taken out of ``init_other``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _timelines import T0, ev, nonzero, run_of, span

from warmstart import _launch
from warmstart.metrics import Recorder, compute, get_recorder, load_runs, write_events
from warmstart.metrics.calculator import Run

JOB = Path(__file__).with_name("_launch_job.py")
_START_UP = ("process_launch", "imports")


def _without_start_up_spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("span") not in _START_UP]


# -- the calculator, by hand -----------------------------------------------------------------------


def test_a_launcher_s_attempt_start_puts_launch_and_imports_in_their_buckets(tmp_path):
    """The launcher (rank -1) records the allocation at 0; the process starts at 1, its interpreter is
    ready at 3, it records its own attempt_start at 3.5 and imports [4, 9), compiles [10, 12) and steps
    at 12. Uncovered: [0, 1) (launching), [3, 4) and [9, 10): init_other 3."""
    launcher = [ev(0, "attempt_start", rank=-1, devices=4)]
    job = [
        *span(1, 3, "process_launch"),
        ev(3.5, "attempt_start", devices=4),
        *span(4, 9, "imports"),
        *span(10, 12, "compile"),
        ev(12, "step", step=0),
        ev(16, "step", step=1),
        ev(20, "train_end"),
        ev(21, "attempt_end"),
    ]
    res = run_of(tmp_path / "with", launcher, job)
    assert nonzero(res.buckets) == {
        "process_launch": 2,
        "imports": 5,
        "compile": 2,
        "init_other": 3,
        "effective_training": 8,
        "shutdown": 1,
    }
    assert res.l1["time_to_start_s"] == pytest.approx(12)
    # Without the two spans the same 7 s were init_other; nothing else moves.
    bare = run_of(tmp_path / "bare", launcher, _without_start_up_spans(job))
    assert nonzero(bare.buckets) == {"compile": 2, "init_other": 10, "effective_training": 8, "shutdown": 1}
    assert (bare.e2e_s, bare.l1) == (res.e2e_s, res.l1)


@pytest.mark.parametrize(
    "attempt_start, expected_launch",
    [
        (2.0, 0.0),  # recorded by the process, after its interpreter was ready: the launch is before the clock
        (1.0, 0.5),  # recorded by a launcher while the process started: only the part after it counts
    ],
)
def test_a_launch_before_attempt_start_is_clipped_to_the_attempt(tmp_path, attempt_start, expected_launch):
    job = [
        *span(0, 1.5, "process_launch"),
        ev(attempt_start, "attempt_start"),
        *span(2, 5, "imports"),
        ev(5, "step", step=0),
        ev(9, "train_end"),
        ev(9, "attempt_end"),
    ]
    res = run_of(tmp_path / "with", job)
    assert res.start_ts == T0 + attempt_start and res.e2e_s == pytest.approx(9 - attempt_start)
    assert res.buckets["process_launch"] == pytest.approx(expected_launch)
    assert res.buckets["imports"] == pytest.approx(3)
    assert res.buckets["init_other"] == pytest.approx(2 - attempt_start - expected_launch)
    # Every other figure is what it was without the launch span: the clock starts at attempt_start.
    bare = run_of(tmp_path / "bare", [e for e in job if e.get("span") != "process_launch"])
    assert (bare.start_ts, bare.e2e_s, bare.ett_pct) == (res.start_ts, res.e2e_s, res.ett_pct)
    assert bare.buckets["init_other"] == pytest.approx(res.buckets["init_other"] + expected_launch)
    assert [m.name for m in res.timeline[0].spans] == (["process_launch"] if expected_launch else []) + ["imports"]


def test_a_restarted_process_s_launch_stays_in_the_recovery_wait(tmp_path):
    """Attempt 0 fails at 10; its replacement process starts at 11 and records attempt_start at 14,
    after its launch [11, 13). The wait [10, 14) is recovery_wait as before; attempt 1 imports [14, 16)
    and steps at 17."""
    a0 = [ev(0, "attempt_start"), ev(5, "step", step=0), ev(10, "failure", reason="oom", category="infra")]
    a1 = [
        *span(11, 13, "process_launch", attempt=1),
        ev(14, "attempt_start", attempt=1),
        *span(14, 16, "imports", attempt=1),
        ev(17, "step", attempt=1, step=0),
        ev(20, "train_end", attempt=1),
        ev(20, "attempt_end", attempt=1),
    ]
    res = run_of(tmp_path / "run", a0, a1)
    assert nonzero(res.buckets) == {
        "init_other": 6,
        "imports": 2,
        "effective_training": 3,
        "lost_progress": 5,
        "recovery_wait": 4,
    }
    assert nonzero(res.attempts[1].buckets) == {
        "recovery_wait": 4,
        "imports": 2,
        "init_other": 1,
        "effective_training": 3,
    }
    assert res.l1["time_to_recover_s"] == pytest.approx(4 + 3)


def test_without_attempt_start_the_window_opens_at_the_launch(tmp_path):
    """The attempt's window starts at its first event when nothing records attempt_start: here the
    OS start of the process, the earliest moment of the attempt anyone measured."""
    res = run_of(
        tmp_path,
        [
            *span(0, 2, "process_launch"),
            *span(2, 5, "imports"),
            ev(5, "step", step=0),
            ev(8, "train_end"),
            ev(8, "attempt_end"),
        ],
    )
    assert res.start_ts == T0 and nonzero(res.buckets) == {"process_launch": 2, "imports": 3, "effective_training": 3}
    assert res.l1["time_to_start_s"] == pytest.approx(5)


# -- the recorder ----------------------------------------------------------------------------------


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_launch_span_waits_for_the_process_s_own_events(tmp_path, monkeypatch):
    monkeypatch.setattr(_launch, "interpreter_ready_ts", T0 + 0.25)
    monkeypatch.setattr(_launch, "process_start_ts", lambda: T0)
    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    assert rec.process_launch() is True and rec.process_launch() is False  # once
    rec.flush()
    assert not rec.path.exists()  # a process that records nothing writes nothing
    rec.attempt_start(devices=1)
    rec.close()
    lines = _lines(rec.path)
    assert [(x["event"], x.get("span"), x["ts"]) for x in lines[:2]] == [
        ("begin", "process_launch", T0),
        ("end", "process_launch", T0 + 0.25),
    ]
    assert [x["event"] for x in lines[2:]] == ["attempt_start"]


def test_a_recorder_that_records_nothing_writes_no_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(_launch, "interpreter_ready_ts", T0 + 0.25)
    monkeypatch.setattr(_launch, "process_start_ts", lambda: T0)
    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    rec.process_launch()
    rec.close()
    assert not rec.path.exists()


@pytest.mark.parametrize(
    "start, ready",
    [
        (None, T0 + 1),  # no /proc
        (T0, None),  # WARMSTART=1 was not set when the interpreter started: no start-up hook ran
        (T0 + 2, T0 + 1),  # a forked child: it started after the hook ran in its parent
    ],
)
def test_no_launch_span_where_an_end_is_unknown(tmp_path, monkeypatch, start, ready):
    monkeypatch.setattr(_launch, "interpreter_ready_ts", ready)
    monkeypatch.setattr(_launch, "process_start_ts", lambda: start)
    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    assert rec.process_launch() is False
    rec.attempt_start()
    rec.close()
    assert [x["event"] for x in _lines(rec.path)] == ["attempt_start"]


def test_the_process_wide_recorder_records_the_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("WARMSTART_JOB_ID", "j")
    monkeypatch.setattr(_launch, "interpreter_ready_ts", T0 + 0.25)
    monkeypatch.setattr(_launch, "process_start_ts", lambda: T0)
    rec = get_recorder()
    rec.attempt_start()
    rec.flush()
    assert [x.get("span") for x in _lines(rec.path)] == ["process_launch", "process_launch", None]


def test_the_process_start_time_is_the_os_s(tmp_path):
    before = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; from warmstart import _launch; print(_launch.process_start_ts(), time.time())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    started, now = float(out[0]), float(out[1])
    tick = 1 / os.sysconf("SC_CLK_TCK")  # the OS counts in ticks, and rounds down
    assert before - tick - 0.005 <= started <= now


# -- a real job process ----------------------------------------------------------------------------


def _job_env(run_dir: Path, cache_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WARMSTART", "TORCHELASTIC")) and k not in ("RANK", "LOCAL_RANK")
    }
    env.update(
        WARMSTART_RUN_DIR=str(run_dir), WARMSTART_JOB_ID="launch-job", WARMSTART_CACHE_DIR=str(cache_dir), **extra
    )
    return env


def _launch_job(run_dir: Path, env: dict[str, str], module: str) -> float:
    """Record the allocation as a launcher would, then start the job; the seconds its import took."""
    write_events(
        run_dir / "launcher.jsonl",
        [{"ts": time.time(), "job": "launch-job", "attempt": 0, "rank": -1, "event": "attempt_start", "devices": 1}],
    )
    done = subprocess.run([sys.executable, str(JOB), module], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_a_job_s_launch_and_imports_leave_init_other(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    import_s = _launch_job(run_dir, _job_env(run_dir, tmp_path / "cache", WARMSTART="1"), "redis")  # ~0.1 s
    (run,) = load_runs([run_dir])
    res = compute(run)
    launcher_ts = res.start_ts
    launch = next(m for m in res.timeline[0].spans if m.name == "process_launch")
    first_own = min(e.ts for e in run.events if e.rank == 0 and getattr(e, "span", None) != "process_launch")
    tick = 1 / os.sysconf("SC_CLK_TCK")
    # The process started after the launcher's attempt_start (to a tick) and was ready before its first event.
    assert launcher_ts - tick - 0.005 <= launch.start < launch.end <= first_own
    assert res.buckets["process_launch"] == pytest.approx(launch.end - max(launch.start, launcher_ts))
    assert res.buckets["process_launch"] > 0
    assert res.buckets["imports"] > 0 and res.buckets["imports"] == pytest.approx(import_s, abs=0.02)
    # The same events without the two spans: all of that time was init_other, and only that moved.
    bare = compute(Run(run.job, run.run_dir, [e for e in run.events if getattr(e, "span", None) not in _START_UP]))
    assert bare.buckets["init_other"] == pytest.approx(
        res.buckets["init_other"] + res.buckets["process_launch"] + res.buckets["imports"], abs=1e-6
    )
    assert bare.l1["time_to_start_s"] == pytest.approx(res.l1["time_to_start_s"], abs=1e-6)
    assert bare.e2e_s == pytest.approx(res.e2e_s, abs=1e-6)


def test_without_the_start_up_hook_a_job_records_no_launch(tmp_path):
    """With a run directory but not WARMSTART=1, no hook marks the interpreter ready: no launch span,
    and that time stays init_other (the imports span is the script's own)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _launch_job(run_dir, _job_env(run_dir, tmp_path / "cache"), "json")
    (run,) = load_runs([run_dir])
    assert not [e for e in run.events if getattr(e, "span", None) == "process_launch"]
    res = compute(run)
    assert res.buckets["process_launch"] == 0 and res.buckets["init_other"] > 0
