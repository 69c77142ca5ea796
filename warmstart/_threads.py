"""Background threads warmstart starts, named where the operating system shows them.

Python (before 3.14) names a thread for ``threading`` only; ``top -H``, ``ps -L``, ``py-spy`` and
``/proc/<pid>/task/*/comm`` show every thread of a job as ``python``. warmstart's threads carry their
own name there too (Linux; elsewhere the Python name only), so a user can see what they cost, and
the benchmarks measure it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable

NATIVE_PREFIX = "ws-"  # every warmstart thread's native name starts with it
_PR_SET_NAME = 15
_COMM_MAX = 15  # the kernel keeps 15 bytes of a thread's name
_libc: ctypes.CDLL | None = None


def native_name(name: str) -> str:
    """The operating system's name for the thread called ``name`` (``warmstart-cache-writer`` ->
    ``ws-cache-writer``): the prefix shortened, cut to the kernel's 15 bytes."""
    short = NATIVE_PREFIX + name.removeprefix("warmstart-")
    return short.encode()[:_COMM_MAX].decode(errors="ignore")


def start_daemon(target: Callable[[], None], name: str) -> threading.Thread:
    """Start ``target`` on a daemon thread called ``name``, and return the thread."""

    def run() -> None:
        _set_native_name(native_name(name))
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _set_native_name(name: str) -> None:
    global _libc
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):  # a name is a courtesy: never a reason for a thread to fail
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()), 0, 0, 0)
