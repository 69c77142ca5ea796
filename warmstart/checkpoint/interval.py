"""The adaptive checkpoint interval: how many steps until the next save, from the measured blocking
time per save and the failure rate.

Between two failures a job loses, on average, half an interval of unsaved work, and pays the
blocking time once per interval; the sum is smallest at ``sqrt(2 * MTBF * blocking)`` (Young's
formula, computed by the metrics advisor behind ``warmstart ett interval``). The policy turns that time into a step
count using the measured time per step, so that every rank can agree on the next save step (rank 0
decides, the checkpointer broadcasts). It owns the arithmetic only; it measures and sends nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warmstart.errors import ConfigError
from warmstart.metrics.advisor import SECONDS_PER_DAY, advise_interval, require_positive


def optimal_interval_s(blocking_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds) that minimises unsaved plus blocked time (0 when nothing blocks).

    Args:
        blocking_s: training time blocked per checkpoint, seconds.
        mtbf_s: mean time between failures of the job, seconds.

    Raises:
        ConfigError: ``mtbf_s`` is not a positive, finite number.
    """
    require_positive("mtbf_s", mtbf_s, "a positive number of seconds")
    if not (blocking_s > 0 and math.isfinite(blocking_s)):
        return 0.0
    return advise_interval(blocking_s, failures_per_day=SECONDS_PER_DAY / mtbf_s).interval_s


@dataclass
class AdaptiveInterval:
    """Picks the next checkpoint step from blocking time, step time and failure rate.

    Example:
        >>> policy = AdaptiveInterval(mtbf_s=8 * 3600, first_steps=200)
        >>> ckpt = Checkpointer("/ckpt/run-1", interval=policy)
        >>> for step in range(start, steps):
        ...     train_step()
        ...     ckpt.maybe_save(step, state)

    Args:
        mtbf_s: mean time between failures of the job, seconds (``86400 / failures_per_day``).
        first_steps: steps until the first save, before anything is measured.
        min_steps: never save more often than this.
        max_steps: never save less often than this (None: no limit).
    """

    mtbf_s: float
    first_steps: int = 100
    min_steps: int = 1
    max_steps: int | None = None

    def __post_init__(self) -> None:
        require_positive("mtbf_s", self.mtbf_s, "a positive number of seconds")
        if self.min_steps < 1 or self.first_steps < 1:
            raise ConfigError("min_steps/first_steps", (self.min_steps, self.first_steps), "integers >= 1")
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise ConfigError("max_steps", self.max_steps, f"None or an integer >= min_steps ({self.min_steps})")
        self._last: tuple[int, float] | None = None  # (step, monotonic time) of the previous save

    @classmethod
    def from_failures_per_day(cls, failures_per_day: float, **kwargs: int | None) -> AdaptiveInterval:
        """The policy for a job that fails ``failures_per_day`` times a day."""
        require_positive("failures_per_day", failures_per_day, "a positive, finite number")
        return cls(mtbf_s=SECONDS_PER_DAY / failures_per_day, **kwargs)  # type: ignore[arg-type]

    def next_step(self, step: int, now_s: float, blocking_s: float | None) -> int:
        """The step of the save after the one at ``step``.

        Args:
            step: the step being saved now.
            now_s: a monotonic clock reading taken now.
            blocking_s: blocking time of the previous save (None before the first one finished).
        """
        last, self._last = self._last, (step, now_s)
        if last is None or blocking_s is None or step <= last[0]:
            return step + self.first_steps
        step_s = (now_s - last[1]) / (step - last[0])
        if step_s <= 0:
            return step + self.first_steps
        steps = round(optimal_interval_s(blocking_s, self.mtbf_s) / step_s)
        steps = max(self.min_steps, steps)
        if self.max_steps is not None:
            steps = min(self.max_steps, steps)
        return step + steps
