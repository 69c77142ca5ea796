"""A circuit breaker for the remote tier: one failure costs one timeout, then the tier stays off
until a background probe finds it healthy again. Calls on the job's path never wait on a probe."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from warmstart import _defaults
from warmstart._threads import start_daemon

log = logging.getLogger("warmstart.cache")


class CircuitBreaker:
    """Closed (calls go through) or open (calls are refused at once) with background re-probing.

    Args:
        probe: called from a daemon thread while open; returns normally when the tier is healthy.
        cooldown_s: first wait before probing; doubles after each failed probe, up to 8x.
    """

    def __init__(
        self, probe: Callable[[], None], cooldown_s: float = _defaults.BREAKER_COOLDOWN_S, name: str = "remote"
    ) -> None:
        self._probe = probe
        self._cooldown_s = cooldown_s
        self._name = name
        self._open = False
        self._lock = threading.Lock()
        self._warned = False
        self._pid = os.getpid()

    def allow(self) -> bool:
        """True if a call may go to the tier now."""
        if self._open and self._pid != os.getpid():
            self._adopt_after_fork()
        return not self._open

    def _adopt_after_fork(self) -> None:
        # Forked while open: the parent's probe thread does not exist here, and without one the tier
        # would stay off for good in this process. Probe again from here.
        self._lock, self._pid = threading.Lock(), os.getpid()
        start_daemon(self._probe_loop, f"warmstart-{self._name}-probe")

    def trip(self, reason: str) -> None:
        """Open the breaker after a failure and start probing in the background."""
        if self._pid != os.getpid():
            self._lock, self._pid, self._open = threading.Lock(), os.getpid(), False
        with self._lock:
            if self._open:
                return
            self._open = True
        if not self._warned:
            log.warning("warmstart: %s cache tier unavailable (%s); continuing without it", self._name, reason)
            self._warned = True
        start_daemon(self._probe_loop, f"warmstart-{self._name}-probe")

    def _probe_loop(self) -> None:
        wait = self._cooldown_s
        while True:
            time.sleep(wait)
            try:
                self._probe()
            except Exception:
                wait = min(wait * 2, self._cooldown_s * 8)
                continue
            with self._lock:
                self._open = False
            log.info("warmstart: %s cache tier is back", self._name)
            return
