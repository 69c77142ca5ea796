"""Fleet ETT%: many jobs' results folded into one figure weighted by device-seconds (docs/reference.md#events).

Fleet ETT% = sum(effective_training * devices) / sum(e2e * devices), a job's devices being the largest
``devices`` of its ``attempt_start`` events (1 when absent). Folding is incremental (:meth:`FleetResult.add`)
so a fleet of thousands of run directories never holds more than one job's events at a time.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from warmstart.metrics.buckets import EFFECTIVE
from warmstart.metrics.calculator import RunResult, ordered_buckets
from warmstart.metrics.window_results import FleetWindow


@dataclasses.dataclass
class FleetResult:
    """Device-second weighted totals over jobs, plus one summary row per job."""

    jobs: int = 0
    device_seconds: float = 0.0
    effective_device_seconds: float = 0.0
    failures: int = 0
    buckets: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    run_buckets: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Each job's buckets in device-seconds, in the order of :attr:`runs` (for the HTML page; not in
    ``--json``)."""
    windows: list[FleetWindow] | None = None
    """Fleet ETT% per time window, when a report asks for them (``warmstart.metrics.windows.FleetWindows``)."""

    @property
    def ett_pct(self) -> float | None:
        """Fleet ETT%, weighted by device-seconds; ``None`` when no job has counted time."""
        return 100.0 * self.effective_device_seconds / self.device_seconds if self.device_seconds else None

    def add(self, result: RunResult) -> None:
        """Fold one job in (a run directory without events adds nothing)."""
        if not result.attempts:
            return
        weight = result.devices
        self.jobs += 1
        self.device_seconds += result.e2e_s * weight
        self.effective_device_seconds += result.buckets.get(EFFECTIVE, 0.0) * weight
        self.failures += int(result.l1.get("failures", 0))
        for name, seconds in result.buckets.items():
            self.buckets[name] += seconds * weight
        self.runs.append(
            {
                "job": result.job,
                "run_dir": result.run_dir,
                "devices": weight,
                "e2e_s": result.e2e_s,
                "device_seconds": result.e2e_s * weight,
                "ett_pct": result.ett_pct,
                "failures": result.l1.get("failures", 0),
            }
        )
        self.run_buckets.append({name: seconds * weight for name, seconds in result.buckets.items()})

    def to_dict(self) -> dict[str, Any]:
        """The ``warmstart ett fleet --json`` object (``buckets`` in device-seconds)."""
        d = {
            "ett_pct": self.ett_pct,
            "jobs": self.jobs,
            "device_seconds": self.device_seconds,
            "effective_device_seconds": self.effective_device_seconds,
            "failures": self.failures,
            "buckets": ordered_buckets(self.buckets),
            "runs": list(self.runs),
        }
        if self.windows is not None:
            d["windows"] = [w.to_dict() for w in self.windows]
        return d
