"""The recorder writes event lines (docs/reference.md#events), flushes on its interval, at exit, on an
uncaught exception and on SIGTERM (real subprocesses, real signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _wait import until

from warmstart.errors import ConfigError
from warmstart.metrics import NullRecorder, Recorder, get_recorder, read_events, reset_process_recorder


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(code: str, env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHELASTIC", "RANK"))}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )


def test_every_call_writes_one_valid_line(tmp_path):
    rec = Recorder(tmp_path, job="job-1", rank=3, attempt=2, flush_interval_s=0)
    rec.attempt_start(devices=8)
    with rec.span("data_loader_init"):
        pass
    rec.begin("warmup", bucket="compile")
    rec.end("warmup", bucket="compile")
    rec.step(0, samples=64)
    rec.step(1)
    rec.checkpoint_committed(1)
    rec.failure('NCCL "timeout"', "infra")
    rec.train_end()
    rec.attempt_end()
    rec.close()
    assert rec.path == tmp_path / "events-r3-a2.jsonl"
    events = read_events(rec.path)
    assert [e.event for e in events] == [
        "attempt_start",
        "begin",
        "end",
        "begin",
        "end",
        "step",
        "step",
        "checkpoint_committed",
        "failure",
        "train_end",
        "attempt_end",
    ]
    assert {(e.job, e.rank, e.attempt) for e in events} == {("job-1", 3, 2)}
    assert events[0].devices == 8
    assert (events[3].span, events[3].bucket) == ("warmup", "compile")
    assert (events[5].step, events[5].samples, events[6].samples) == (0, 64, None)
    assert (events[8].reason, events[8].category) == ('NCCL "timeout"', "infra")
    assert [e.ts for e in events] == sorted(e.ts for e in events)


def test_failure_category_is_checked(tmp_path):
    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    with pytest.raises(ValueError, match="infra, preemption, user"):
        rec.failure("boom", "cosmic-ray")
    rec.close()


def test_background_thread_flushes_on_its_interval(tmp_path):
    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0.05)
    rec.step(7)
    until(rec.path.exists, timeout=5)
    assert _lines(rec.path)[0]["step"] == 7
    rec.close()


def test_close_is_idempotent_and_appends(tmp_path):
    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    rec.step(0)
    rec.close()
    rec.close()
    again = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    again.step(1)
    again.close()
    assert [line["step"] for line in _lines(rec.path)] == [0, 1]


def test_identity_comes_from_torchrun_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-9")
    monkeypatch.delenv("WARMSTART_JOB_ID", raising=False)
    monkeypatch.delenv("WARMSTART_ATTEMPT", raising=False)
    rec = Recorder(tmp_path, flush_interval_s=0)
    assert (rec.job, rec.rank, rec.attempt) == ("rdzv-9", 5, 2)
    rec.close()
    monkeypatch.setenv("WARMSTART_ATTEMPT", "4")  # a scheduler's requeue count beats torchrun's
    rec = Recorder(tmp_path, flush_interval_s=0)
    assert rec.attempt == 4 and rec.path.name == "events-r5-a4.jsonl"
    rec.close()
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ConfigError, match="RANK='zero'"):
        Recorder(tmp_path)


def test_get_recorder_is_a_noop_when_off(monkeypatch):
    for var in ("WARMSTART", "WARMSTART_RUN_DIR"):
        monkeypatch.delenv(var, raising=False)
    try:
        rec = get_recorder()
        assert isinstance(rec, NullRecorder) and not rec.enabled
        with rec.span("compile"):
            rec.step(0)
        assert get_recorder() is rec
    finally:
        reset_process_recorder()


def test_get_recorder_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("WARMSTART_JOB_ID", "job-env")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WARMSTART_ATTEMPT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    try:
        rec = get_recorder()
        assert isinstance(rec, Recorder) and get_recorder() is rec
        rec.step(3)
        rec.flush()
        assert _lines(tmp_path / "events-r1-a0.jsonl")[0] == {
            **_lines(tmp_path / "events-r1-a0.jsonl")[0],
            "job": "job-env",
            "rank": 1,
            "step": 3,
        }
    finally:
        reset_process_recorder()


def test_exit_flushes_and_ends_the_open_attempt(tmp_path):
    proc = _run(
        """
        from warmstart.metrics import get_recorder
        rec = get_recorder()
        rec.attempt_start(devices=2)
        rec.step(0)
        rec.train_end()
    """,
        {"WARMSTART_RUN_DIR": str(tmp_path), "WARMSTART_JOB_ID": "j"},
    )
    assert proc.returncode == 0, proc.stderr
    assert [line["event"] for line in _lines(tmp_path / "events-r0-a0.jsonl")] == [
        "attempt_start",
        "step",
        "train_end",
        "attempt_end",
    ]


def test_uncaught_exception_writes_failure_and_chains_excepthook(tmp_path):
    proc = _run(
        """
        import sys
        def previous(t, e, tb):
            print("previous hook saw", t.__name__, file=sys.stderr)
        sys.excepthook = previous
        from warmstart.metrics import get_recorder
        rec = get_recorder()
        rec.attempt_start()
        rec.step(0)
        raise ConnectionError("peer went away")
    """,
        {"WARMSTART_RUN_DIR": str(tmp_path), "WARMSTART_JOB_ID": "j", "RANK": "1"},
    )
    assert proc.returncode == 1
    assert "previous hook saw ConnectionError" in proc.stderr
    lines = _lines(tmp_path / "events-r1-a0.jsonl")
    assert [line["event"] for line in lines] == ["attempt_start", "step", "failure", "attempt_end"]
    assert lines[2]["category"] == "infra" and "peer went away" in lines[2]["reason"]


def test_user_error_is_categorized_user(tmp_path):
    proc = _run(
        """
        from warmstart.metrics import get_recorder
        get_recorder().step(0)
        raise KeyError("missing feature")
    """,
        {"WARMSTART_RUN_DIR": str(tmp_path), "WARMSTART_JOB_ID": "j"},
    )
    assert proc.returncode == 1
    failure = [line for line in _lines(tmp_path / "events-r0-a0.jsonl") if line["event"] == "failure"]
    assert failure[0]["category"] == "user" and failure[0]["reason"].startswith("KeyError")


def test_sigterm_writes_failure_flushes_and_dies_by_the_signal(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import sys, time
        from warmstart.metrics import get_recorder
        rec = get_recorder()
        rec.attempt_start()
        for n in range(3):
            rec.step(n)
        print("ready", flush=True)
        for _ in range(600):  # short sleeps: a signal just before one long sleep waits for its end
            time.sleep(0.1)
    """),
        ],
        env={
            **os.environ,
            "WARMSTART_RUN_DIR": str(tmp_path),
            "WARMSTART_JOB_ID": "j",
            "RANK": "0",
            "WARMSTART_ATTEMPT": "1",
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    lines = _lines(tmp_path / "events-r0-a1.jsonl")
    assert [line["event"] for line in lines] == ["attempt_start", "step", "step", "step", "failure", "attempt_end"]
    assert (lines[4]["reason"], lines[4]["category"]) == ("SIGTERM", "preemption")


def test_sigterm_chains_a_previous_python_handler(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import os, signal, sys, time
        def previous(signum, frame):
            print("previous handler ran", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, previous)
        from warmstart.metrics import get_recorder
        get_recorder().step(0)
        # Not print(): the test reads the line once it is written, and its SIGTERM may come while
        # print() is still inside stdout's buffer, where the handler's print() is a reentrant call.
        os.write(1, b"ready\\n")
        for _ in range(600):  # short sleeps: a signal just before one long sleep waits for its end
            time.sleep(0.1)
    """),
        ],
        env={**os.environ, "WARMSTART_RUN_DIR": str(tmp_path), "WARMSTART_JOB_ID": "j", "RANK": "0"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 7
        assert "previous handler ran" in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    events = [line["event"] for line in _lines(tmp_path / "events-r0-a0.jsonl")]
    assert events == ["step", "failure"]


def test_a_process_that_recorded_nothing_writes_nothing(tmp_path):
    proc = _run(
        """
        from warmstart.metrics import get_recorder
        get_recorder()
        raise RuntimeError("a compile worker dies")
    """,
        {"WARMSTART_RUN_DIR": str(tmp_path), "WARMSTART_JOB_ID": "j"},
    )
    assert proc.returncode == 1
    assert list(tmp_path.iterdir()) == []


def test_forked_child_does_not_duplicate_or_claim_the_attempt(tmp_path):
    proc = _run(
        """
        import os
        from warmstart.metrics import get_recorder
        rec = get_recorder()
        rec.attempt_start()
        rec.step(0)
        pid = os.fork()
        if pid == 0:
            raise SystemExit(0)   # a forked helper (e.g. a data loader worker) exits normally
        os.waitpid(pid, 0)
        rec.step(1)
    """,
        {"WARMSTART_RUN_DIR": str(tmp_path), "WARMSTART_JOB_ID": "j"},
    )
    assert proc.returncode == 0, proc.stderr
    events = [(line["event"], line.get("step")) for line in _lines(tmp_path / "events-r0-a0.jsonl")]
    assert events == [("attempt_start", None), ("step", 0), ("step", 1), ("attempt_end", None)]


def test_two_threads_forking_at_once_each_release_only_their_own_hold(tmp_path):
    # Thread A holds the flush lock across a fork that takes more than a second (a large process);
    # thread B's fork meanwhile gives up waiting for it. B's fork ending must not release A's hold
    # (nor fail), and once A's ends the flusher writes again: the attempt's events keep coming.
    proc = _run(
        """
        import threading, time
        from warmstart.metrics import get_recorder, recorder
        rec = get_recorder()
        rec.attempt_start()
        a_held, b_done = threading.Event(), threading.Event()

        def a():
            recorder._before_fork()  # holds the lock, as during its fork
            a_held.set()
            b_done.wait(10)
            recorder._after_fork_in_parent()

        def b():
            a_held.wait(10)
            recorder._before_fork()  # waits its second, then forks without the lock
            recorder._after_fork_in_parent()
            b_done.set()

        threads = [threading.Thread(target=f) for f in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        rec.step(0)
        flushed = threading.Thread(target=rec.flush, daemon=True)
        flushed.start()
        flushed.join(5)
        print("flushed" if not flushed.is_alive() else "flush blocked")
    """,
        {"WARMSTART_RUN_DIR": str(tmp_path), "WARMSTART_JOB_ID": "j"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "flushed", proc.stderr
    assert "RuntimeError" not in proc.stderr
    events = [line["event"] for line in _lines(tmp_path / "events-r0-a0.jsonl")]
    assert events[:2] == ["attempt_start", "step"]


def test_a_bad_rank_is_an_error_only_when_metrics_are_on(tmp_path, monkeypatch):
    for var in ("WARMSTART", "WARMSTART_RUN_DIR", "WARMSTART_ATTEMPT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x")
    try:
        assert isinstance(get_recorder(), NullRecorder)  # library code asks in jobs without metrics
        reset_process_recorder()
        monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path))
        with pytest.raises(ConfigError, match="RANK='zero'|TORCHELASTIC_RESTART_COUNT='x'"):
            get_recorder()
    finally:
        reset_process_recorder()


class _Index:
    """An integer that is not an int (numpy's and torch's are like this)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_integer_like_values_are_written_and_invalid_events_dropped_alone(tmp_path, caplog):
    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    rec.step(_Index(4), samples=_Index(8))  # type: ignore[arg-type]
    rec.step("five")  # type: ignore[arg-type]
    rec.begin("")
    rec.step(6)
    rec.close()
    assert [(e.step, e.samples) for e in read_events(rec.path)] == [(4, 8), (6, None)]
    assert [r.message for r in caplog.records if "dropping an invalid ETT event" in r.message] == [
        f"warmstart: dropping an invalid ETT event for {rec.path} (event 0: field 'step' must be an integer, "
        f"got 'five')"
    ]


def test_buffered_events_are_left_out_of_garbage_collections(tmp_path):
    """A million buffered events must cost the cyclic GC nothing: their tuples hold atomic values only."""
    import gc

    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    rec.step(0, samples=8)
    rec.begin("compile")
    rec.failure("boom", "user")
    gc.collect()
    assert not any(gc.is_tracked(record) for record in rec._buf)
    rec.close()
