"""Waiting for what another thread or process brings about: poll a condition until it holds. The
deadline is a hang guard, far above any healthy run, never a speed check."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(predicate: Callable[[], object], timeout: float = 20.0, *, poll_s: float = 0.02) -> None:
    """Return once ``predicate()`` is true; fail the test when it is still false after ``timeout``
    seconds (a hang guard)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not reached within {timeout:g} s (hang guard)"
        time.sleep(poll_s)
