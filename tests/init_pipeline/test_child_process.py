"""``call_in_subprocess`` forked while another thread of the parent imports a module: the child must
not inherit that module's import lock and wait on it for ever (the sharding planner's child, forked
while a compile thread imported part of torch, did)."""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import sys
import threading
import time
from pathlib import Path

from _wait import until

from warmstart.init_pipeline import call_in_subprocess


def _slow_module(tmp_path, hold_s: float) -> tuple[str, threading.Thread, Path]:
    """A module being imported by a thread of this process (returned once the import is under way,
    its lock held): the import ends after ``hold_s``, or as soon as the returned file exists."""
    name = f"_ws_slow_import_{secrets.token_hex(4)}"
    started, release = tmp_path / f"{name}.started", tmp_path / f"{name}.release"
    (tmp_path / f"{name}.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        f"end = time.monotonic() + {hold_s}\n"
        f"while time.monotonic() < end and not pathlib.Path({str(release)!r}).exists():\n"
        "    time.sleep(0.01)\n"
        "VALUE = 42\n"
    )
    sys.path.insert(0, str(tmp_path))
    thread = threading.Thread(target=importlib.import_module, args=(name,), daemon=True)
    thread.start()
    until(started.exists, timeout=10)
    return name, thread, release


def _imports_and_says_where(name: str) -> tuple[int, int]:
    return os.getpid(), importlib.import_module(name).VALUE


def test_a_child_forked_during_another_threads_import_is_forked_again_once_it_is_done(tmp_path):
    name, thread, _ = _slow_module(tmp_path, hold_s=0.4)
    try:
        start = time.monotonic()
        pid, value = call_in_subprocess(_imports_and_says_where, {"name": name}, timeout_s=30, name="probe")
        assert value == 42
        assert pid != os.getpid()  # a child ran it, forked after the import ended
        assert time.monotonic() - start < 10
    finally:
        thread.join(10)
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_an_import_that_outlasts_the_retries_runs_the_function_in_the_calling_thread(tmp_path):
    # The import goes on until the function falls back to the calling thread (its debug line), so
    # every fork finds it under way, however slow the machine.
    name, thread, release = _slow_module(tmp_path, hold_s=60)

    class _ReleaseAtFallback(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "running it here" in record.getMessage():
                release.touch()

    logger = logging.getLogger("warmstart.init_pipeline")
    handler, level = _ReleaseAtFallback(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        pid, value = call_in_subprocess(_imports_and_says_where, {"name": name}, timeout_s=30, name="probe")
        assert (pid, value) == (os.getpid(), 42)  # here, once the other thread's import ended
        assert release.exists()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        release.touch()
        thread.join(10)
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_a_child_forked_with_no_import_under_way_runs_the_function():
    assert call_in_subprocess(os.getpid, name="probe") != os.getpid()


_held_by_a_thread = threading.Lock()


def _takes_the_lock_and_says_where() -> int:
    with _held_by_a_thread:
        return os.getpid()


def _computes_for(seconds: float) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))
    return os.getpid()


def test_a_child_stuck_on_a_lock_copied_at_its_fork_is_given_up_after_stall_s():
    # A thread of the parent holds a lock at the fork, until the function falls back to this thread
    # (its warning): the child's copy of the lock is never released, and the child uses no CPU.
    release = threading.Event()
    taken = threading.Event()

    def hold() -> None:
        with _held_by_a_thread:
            taken.set()
            release.wait(60)

    class _ReleaseAtFallback(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "used no CPU" in record.getMessage():
                release.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(10)
    logger = logging.getLogger("warmstart.init_pipeline")
    handler = _ReleaseAtFallback()
    logger.addHandler(handler)
    try:
        start = time.monotonic()
        pid = call_in_subprocess(_takes_the_lock_and_says_where, timeout_s=60, stall_s=1.0, name="probe")
        assert pid == os.getpid()  # run here, once the thread let go
        assert release.is_set()
        assert time.monotonic() - start < 20
    finally:
        logger.removeHandler(handler)
        release.set()
        thread.join(10)


def test_a_child_that_computes_longer_than_stall_s_is_left_to_finish():
    assert call_in_subprocess(_computes_for, {"seconds": 2.0}, timeout_s=60, stall_s=0.5, name="probe") != os.getpid()
