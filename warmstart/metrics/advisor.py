"""The checkpoint-interval advisor: the interval that minimises blocked plus lost time, and the waste at it.

First-order model (Young, 1974). A checkpoint blocks training for ``b`` seconds every ``I`` seconds and
failures arrive on average every ``T = 86400 / N`` seconds (``N`` failures per day). The share of wall
time wasted is ``b / I`` (blocked) plus ``I / (2 T)`` (on average half an interval of progress is lost
per failure). It is smallest at ``I* = sqrt(2 T b)``, where the waste is ``sqrt(2 b / T)``. The model
leaves out restart cost (a constant per failure, whatever ``I``) and is accurate while ``I << T``.
"""

from __future__ import annotations

import dataclasses
import math

from warmstart.errors import ConfigError

SECONDS_PER_DAY = 86400.0


@dataclasses.dataclass(frozen=True)
class IntervalAdvice:
    """What ``warmstart ett interval`` reports; fractions are percentages of wall time."""

    blocking_s: float
    failures_per_day: float
    mtbf_s: float
    interval_s: float
    waste_pct: float
    blocked_pct: float
    lost_pct: float
    first_order_valid: bool
    current_interval_s: float | None = None
    current_waste_pct: float | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict; its keys are listed in docs/reference.md#warmstart-ett-interval."""
        return dataclasses.asdict(self)


def waste_fraction(interval_s: float, blocking_s: float, mtbf_s: float) -> float:
    """Share of wall time lost to checkpoint blocking plus lost progress at interval ``interval_s``."""
    return blocking_s / interval_s + interval_s / (2.0 * mtbf_s)


def advise_interval(
    blocking_s: float, failures_per_day: float, current_interval_s: float | None = None
) -> IntervalAdvice:
    """The optimal checkpoint interval ``sqrt(2 * T * b)`` with ``T = 86400 / failures_per_day``.

    Args:
        blocking_s: seconds one checkpoint blocks training.
        failures_per_day: failures (of any kind) per day of training.
        current_interval_s: the interval in use, to report its waste next to the optimum.

    Raises:
        ConfigError: a value is not a positive, finite number.
    """
    require_positive("--blocking", blocking_s, "a positive number of seconds")
    require_positive("--failures-per-day", failures_per_day, "a positive number of failures per day")
    if current_interval_s is not None:
        require_positive("--current", current_interval_s, "a positive number of seconds")
    mtbf = SECONDS_PER_DAY / failures_per_day
    interval = math.sqrt(2.0 * mtbf * blocking_s)
    blocked, lost = blocking_s / interval, interval / (2.0 * mtbf)
    current_waste = None
    if current_interval_s is not None:
        current_waste = 100.0 * waste_fraction(current_interval_s, blocking_s, mtbf)
    return IntervalAdvice(
        blocking_s=blocking_s,
        failures_per_day=failures_per_day,
        mtbf_s=mtbf,
        interval_s=interval,
        waste_pct=100.0 * (blocked + lost),
        blocked_pct=100.0 * blocked,
        lost_pct=100.0 * lost,
        first_order_valid=interval <= mtbf / 2,
        current_interval_s=current_interval_s,
        current_waste_pct=current_waste,
    )


def require_positive(option: str, value: float, accepted: str) -> None:
    """Raise :class:`ConfigError` naming ``option`` unless ``value`` is a positive, finite number."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(option, value, accepted)
