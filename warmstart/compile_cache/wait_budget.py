"""One time budget per process for everything warmstart waits on that is not the job's own compile.

Each fault the cache can meet has a bound of its own (a server deadline, a lease's wait, a lock
timeout), but a bound per operation multiplies with the operations a job makes: a server that
answers just under its deadline, or a lease planted on every entry, would cost that bound once per
entry. So every second spent waiting on the cache (a remote or local tier operation on the job's
thread, a peer's lease, the exit flush) is also charged here, and once ``WARMSTART_MAX_WAIT_S`` is
spent the process stops waiting: single-flight is off, and the remote tier is left out, with one
warning. A fault then costs the budget at most, in total, whatever its shape.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("warmstart.cache")


class WaitBudget:
    """Seconds this process may still spend waiting on the cache.

    Args:
        total_s: the whole budget (``WARMSTART_MAX_WAIT_S``); ``0`` spends it at the first wait.
    """

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self._spent = 0.0
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._warned = False

    @property
    def spent_s(self) -> float:
        """Seconds charged so far."""
        return self._spent

    def remaining(self) -> float:
        """Seconds left (0 once spent)."""
        return max(0.0, self.total_s - self._spent)

    @property
    def exhausted(self) -> bool:
        return self._spent >= self.total_s

    def charge(self, seconds: float, what: str) -> None:
        """Count ``seconds`` spent waiting on ``what``; the first charge past the budget warns."""
        if seconds <= 0:
            return
        if self._pid != os.getpid():  # a forked child starts with the whole budget, and a lock of its own
            self._lock, self._spent, self._warned, self._pid = threading.Lock(), 0.0, False, os.getpid()
        with self._lock:
            self._spent += seconds
            warn = self._spent >= self.total_s and not self._warned
            self._warned = self._warned or warn
        if warn:
            log.warning(
                "warmstart: this process has spent its %.0f s of waiting on the cache (WARMSTART_MAX_WAIT_S; "
                "the last on %s): it waits no more (no waiting for peers' compiles, no remote tier)",
                self.total_s,
                what,
            )

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Charge the time the body takes."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.charge(time.monotonic() - start, what)
