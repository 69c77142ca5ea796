"""Run one function in a forked child and bring its result back: heavy pure-Python work (sharding-plan
search) off the parent's GIL, so the parent's threads keep running at full speed.

A fork copies the parent's locks as they are, and only the forking thread: a module another thread
was importing at that moment stays locked in the child forever, and the child's first import of it
(torch imports lazily, often) would wait for ever. So the child first looks for such locks; a child
that finds one says so and is forked again a moment later, when that import is done, and after a
few tries the function runs in the calling thread instead. For work that computes without waiting
(a planner), ``stall_s`` also covers any other lock copied held: a child that has used no CPU for
that long is stuck, and the function runs in the calling thread.

Example:
    >>> import os
    >>> call_in_subprocess(os.getpid, name="pid") != os.getpid()
    True
"""

from __future__ import annotations

import importlib._bootstrap
import logging
import multiprocessing
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("warmstart.init_pipeline")

_UNSAFE = "unsafe"  # the child's answer when it was forked while another thread imported a module
_STALLED = "stalled"  # a child that used no CPU for stall_s (stuck on a lock copied at the fork)
_POLL_S = 0.25  # how often a stall_s watch reads the child's CPU time
_FORK_RETRIES_S = (0.05, 0.1, 0.2, 0.4, 0.8)  # waits before forking again; then the calling thread runs it


def call_in_subprocess(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
    stall_s: float | None = None,
    name: str = "subprocess",
) -> Any:
    """Run ``fn(**kwargs)`` in a forked child and return its (pickled) result.

    The child inherits the parent's memory, so nothing but the result crosses the process boundary;
    it holds its own GIL, so pure-Python work there does not slow the parent's threads. Where ``fork``
    is not available the call runs in the calling thread.

    Args:
        fn: the work; it must not use threads of the parent (they do not exist in the child).
        kwargs: its keyword arguments.
        timeout_s: kill the child and raise ``TimeoutError`` after this many seconds.
        stall_s: for work that never waits: a child that has used no CPU for this many seconds is
            killed and ``fn`` runs in the calling thread (read from ``/proc``; not watched without it).
        name: used in error messages.

    Returns:
        What ``fn`` returned.

    Raises:
        Exception: what ``fn`` raised (re-raised in the parent when it pickles, else a ``RuntimeError``
            carrying its text and traceback), ``TimeoutError``, or ``RuntimeError`` if the child died.
    """
    kwargs = dict(kwargs or {})
    if "fork" not in multiprocessing.get_all_start_methods():
        return fn(**kwargs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for wait_s in (*_FORK_RETRIES_S, None):
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        status, payload = _fork_once(fn, kwargs, remaining, timeout_s, stall_s, name)
        if status == _STALLED:
            log.warning(
                "warmstart: %s: its child process used no CPU for %g s (stuck on a lock copied at its fork); "
                "running it in this process",
                name,
                stall_s,
            )
            return fn(**kwargs)
        if status != _UNSAFE:
            break
        if wait_s is None or (deadline is not None and time.monotonic() + wait_s >= deadline):
            log.debug("warmstart: %s: modules %s were being imported at each fork; running it here", name, payload)
            return fn(**kwargs)
        time.sleep(wait_s)
    if status == "ok":
        return payload
    if isinstance(payload, BaseException):
        raise payload
    raise RuntimeError(f"{name} subprocess failed:\n{payload}")


def _fork_once(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    remaining_s: float | None,
    timeout_s: float | None,
    stall_s: float | None,
    name: str,
) -> tuple[str, Any]:
    """One forked child's answer: ``("ok", result)``, ``("error", exception or text)``,
    ``(_UNSAFE, module names)`` when it was forked while another thread held those modules' import
    locks, or ``(_STALLED, None)`` when it used no CPU for ``stall_s``."""
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(sender, fn, kwargs), name=f"warmstart-{name}", daemon=True)
    child.start()
    sender.close()
    try:
        waited = _wait_for_answer(receiver, child.pid, remaining_s, stall_s)
        if waited == _STALLED:
            return _STALLED, None
        if waited == "timeout":
            raise TimeoutError(f"{name} did not finish within {timeout_s:g} s")
        try:
            return pickle.loads(receiver.recv_bytes())
        except EOFError:
            child.join(1.0)
            raise RuntimeError(f"{name} subprocess died (exit code {child.exitcode}) before returning") from None
    finally:
        receiver.close()
        if child.is_alive():
            child.join(0.5)
        if child.is_alive():
            child.kill()
            child.join(1.0)


def _wait_for_answer(receiver: Any, pid: int | None, remaining_s: float | None, stall_s: float | None) -> str:
    """``"answer"`` once the child's answer is there, ``"timeout"`` when ``remaining_s`` passed first,
    ``_STALLED`` (with ``stall_s``) when the child used no CPU for ``stall_s`` before either."""
    if stall_s is None or pid is None or _cpu_ticks(pid) is None:
        return "answer" if receiver.poll(remaining_s) else "timeout"
    end = None if remaining_s is None else time.monotonic() + remaining_s
    ticks, since = _cpu_ticks(pid), time.monotonic()
    while True:
        wait = _POLL_S if end is None else min(_POLL_S, max(0.0, end - time.monotonic()))
        if receiver.poll(wait):
            return "answer"
        now = time.monotonic()
        if end is not None and now >= end:
            return "timeout"
        current = _cpu_ticks(pid)
        if current != ticks:
            ticks, since = current, now
        elif now - since >= stall_s:
            return _STALLED


def _cpu_ticks(pid: int) -> int | None:
    """User plus system CPU time of ``pid`` in clock ticks (``/proc/<pid>/stat``); None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of the line
    except (OSError, IndexError, ValueError):
        return None


def _imports_held_by_other_threads() -> list[str]:
    """In a forked child: the modules whose import lock a thread of the parent held at the fork (that
    thread is not here, so they stay locked). Read from importlib's own lock table (``count`` is an
    int in Python 3.11, a list from 3.12; imported before the fork, so that the child imports nothing
    to look); empty where that table is not as expected."""
    me = threading.get_ident()
    held = []
    try:
        for ref in list(importlib._bootstrap._module_locks.values()):  # type: ignore[attr-defined]
            lock = ref() if callable(ref) else ref
            if lock is not None and lock.count and lock.owner != me:
                held.append(lock.name)
    except (AttributeError, TypeError):  # another Python: the child runs as before
        return []
    return held


def _child_main(sender: Any, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    held = _imports_held_by_other_threads()
    if held:  # the first import of one of them would wait for ever: fork again later
        sender.send_bytes(pickle.dumps((_UNSAFE, held)))
        sender.close()
        os._exit(0)
    try:
        result = ("ok", fn(**kwargs))
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        try:
            data = pickle.dumps(("error", exc), protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(data)  # an exception that pickles but does not unpickle would fail the parent
        except Exception:  # noqa: BLE001
            data = pickle.dumps(("error", "".join(traceback.format_exception(exc))))
    sender.send_bytes(data)
    sender.close()
    # Skip atexit hooks and finalizers inherited from the parent (stores, recorders, loggers).
    os._exit(0)
