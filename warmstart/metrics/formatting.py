"""How the reports write figures: durations, shares, ETT% and its grade, the slow-steps summary, the
background compiles' switches.

Shared by the terminal tables (``report``) and the HTML page (``report_html``), so that both say the
same thing the same way.
"""

from __future__ import annotations

from warmstart.metrics.steps import SlowSteps
from warmstart.metrics.switches import CompileSwitch

L1_LABELS = (  # the L1 figures a run's report lists, in order, with their labels
    ("time_to_start_s", "time to start"),
    ("time_to_recover_s", "time to recover"),
    ("lost_progress_s", "lost progress"),
    ("checkpoint_blocking_s", "checkpoint blocking"),
    ("shutdown_s", "shutdown"),
)


def format_duration(seconds: float) -> str:
    """``3725.4`` -> ``1h 02m 05s``; under a minute, seconds with two decimals."""
    if seconds < 60:
        return f"{seconds:.2f} s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def pct_text(part: float, whole: float) -> str:
    """``part`` as a share of ``whole``, ``"12.5%"``; ``"-"`` when ``whole`` holds nothing."""
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def ett_grade(ett_pct: float | None) -> str:
    """The headline's grade (its colour in both formats): 80% and up good, 50% fair, below poor."""
    return "poor" if ett_pct is None else "good" if ett_pct >= 80 else "fair" if ett_pct >= 50 else "poor"


def ett_text(ett_pct: float | None) -> str:
    """An ETT% as reports write it; ``"-"`` for none."""
    return "-" if ett_pct is None else f"{ett_pct:.1f}%"


def step_time(seconds: float) -> str:
    """Step-sized durations: milliseconds under a second."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else format_duration(seconds)


def slow_summary(slow: SlowSteps, ideal_s: float, slow_above_s: float, e2e_s: float) -> str:
    """The slow-steps diagnostic in one sentence (its parts separated by ``"; "``)."""
    ideal = f"ideal step {step_time(ideal_s)} (trimmed median of {slow.measured_steps:,} steps of rank {slow.rank})"
    if not slow.slow_count:
        return f"slow steps: none slower than {step_time(slow_above_s)}; {ideal}"
    return (
        f"slow steps: {ideal}; {slow.slow_count:,} slower than {step_time(slow_above_s)} "
        f"lost {format_duration(slow.lost_s)} ({pct_text(slow.lost_s, e2e_s)} of end-to-end)"
    )


#: The stragglers table's columns, and what its lag is.
STRAGGLER_COLUMNS = ("rank", "lagged steps", "lag, summed", "worst (attempt/step: lag)")
LAG_NOTE = (
    "lag: how long after every other rank's a rank's step ended, summed over the steps it lagged; "
    "the other ranks waited that long at their next collective"
)


def rank_rows(ranks: dict, effective: str) -> list[tuple[str, str, str]]:
    """One row per rank: the rank, its ETT% and its largest bucket other than ``effective``."""
    rows = []
    for rank, data in sorted(ranks.items()):
        others = {k: v for k, v in data.buckets.items() if k != effective and v > 0}
        worst = max(others, key=others.__getitem__) if others else None
        rows.append(
            (
                str(rank),
                ett_text(data.ett_pct).rstrip("%"),
                f"{worst} {pct_text(others[worst], data.e2e_s)}" if worst else "-",
            )
        )
    return rows


SWITCH_TITLE = "background compiles: when each rank switched from eager to compiled"
#: ``eager (n)``, ``compiled (n)``: the median step time before and after, over ``n`` steps.
SWITCH_COLUMNS = ("attempt", "rank", "switched at", "in step", "eager (n)", "compiled (n)", "speed-up")


def switch_row(s: CompileSwitch) -> tuple[str, ...]:
    """One rank's switch as the reports' row (:data:`SWITCH_COLUMNS`): when (from the attempt's start;
    a range when several functions switched), the step it fell in, and the median step time on either
    side with the number of steps it is taken over."""
    at = format_duration(s.at_s)
    if s.switches > 1:
        at += f" - {format_duration(s.last_at_s)} ({s.switches} switched)"

    def median(value: float | None, count: int) -> str:
        return "-" if value is None else f"{step_time(value)} ({count:,})"

    speed_up = f"{s.eager_step_s / s.compiled_step_s:.2f}x" if s.eager_step_s is not None and s.compiled_step_s else "-"
    return (
        str(s.attempt),
        str(s.rank),
        at,
        "-" if s.during_step is None else f"{s.during_step:,}",
        median(s.eager_step_s, s.eager_steps),
        median(s.compiled_step_s, s.compiled_steps),
        speed_up,
    )
