"""``call_in_subprocess`` forked while another thread of the parent imports a module: the child must
not inherit that module's import lock and wait on it for ever (the sharding planner's child, forked
while a compile thread imported part of torch, did)."""

from __future__ import annotations

import importlib
import os
import secrets
import sys
import threading
import time

from _wait import until

from warmstart.init_pipeline import call_in_subprocess


def _slow_module(tmp_path, hold_s: float) -> tuple[str, threading.Thread]:
    """A module whose import takes ``hold_s``, being imported by a thread of this process (returned
    once the import is under way, its lock held)."""
    name = f"_ws_slow_import_{secrets.token_hex(4)}"
    started = tmp_path / f"{name}.started"
    (tmp_path / f"{name}.py").write_text(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep({hold_s})\nVALUE = 42\n"
    )
    sys.path.insert(0, str(tmp_path))
    thread = threading.Thread(target=importlib.import_module, args=(name,), daemon=True)
    thread.start()
    until(started.exists, timeout=10)
    return name, thread


def _imports_and_says_where(name: str) -> tuple[int, int]:
    return os.getpid(), importlib.import_module(name).VALUE


def test_a_child_forked_during_another_threads_import_is_forked_again_once_it_is_done(tmp_path):
    name, thread = _slow_module(tmp_path, hold_s=0.4)
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
    name, thread = _slow_module(tmp_path, hold_s=4.0)
    try:
        pid, value = call_in_subprocess(_imports_and_says_where, {"name": name}, timeout_s=30, name="probe")
        assert (pid, value) == (os.getpid(), 42)  # here, once the other thread's import ended
    finally:
        thread.join(10)
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_a_child_forked_with_no_import_under_way_runs_the_function():
    assert call_in_subprocess(os.getpid, name="probe") != os.getpid()
