"""The results of time windows: one job's ETT% per window, and a fleet's. Plain data, shared by the
calculator's :class:`~warmstart.metrics.calculator.RunResult`, the fleet's totals and the reports;
``windows`` computes them and owns every rule about what a window counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Window:
    """ETT% of one window of a job's time (excluded ranges not counted)."""

    since: float
    until: float
    e2e_s: float
    """The counted seconds of the job in the window."""
    ett_pct: float | None
    """None when the window counts no time of the job."""
    buckets: dict[str, float]
    failures: int

    def to_dict(self) -> dict[str, Any]:
        """The ``windows`` entries of ``warmstart ett report --json``."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class FleetWindow:
    """Fleet ETT% of one window, weighted by device-seconds like the fleet total."""

    since: float
    until: float
    jobs: int
    """Jobs with counted time in the window."""
    device_seconds: float
    effective_device_seconds: float
    ett_pct: float | None
    buckets: dict[str, float]
    """Bucket -> device-seconds."""
    failures: int

    def to_dict(self) -> dict[str, Any]:
        """The ``windows`` entries of ``warmstart ett fleet --json``."""
        return dataclasses.asdict(self)
