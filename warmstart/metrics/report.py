"""Reports of ETT results in the terminal (rich tables) and as JSON.

Every format is drawn from the same result objects (:class:`~warmstart.metrics.calculator.RunResult`,
:class:`~warmstart.metrics.fleet.FleetResult`, :class:`~warmstart.metrics.advisor.IntervalAdvice`);
nothing here computes a bucket. The self-contained HTML page is ``report_html``'s; how figures are
written, for both, is ``formatting``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from warmstart.metrics.advisor import IntervalAdvice
from warmstart.metrics.buckets import EFFECTIVE, LOST, RECOVERY
from warmstart.metrics.calculator import RunResult
from warmstart.metrics.fleet import FleetResult
from warmstart.metrics.formatting import (
    L1_LABELS,
    LAG_NOTE,
    STRAGGLER_COLUMNS,
    SWITCH_COLUMNS,
    SWITCH_TITLE,
    ett_grade,
    ett_text,
    format_duration,
    pct_text,
    rank_rows,
    slow_summary,
    step_time,
    switch_row,
)
from warmstart.metrics.projection import Projection
from warmstart.metrics.window_results import FleetWindow, Window


def _bar(fraction: float, width: int = 20) -> str:
    filled = max(0, min(width, int(round(fraction * width))))
    return "█" * filled + "·" * (width - filled)


def _console(console: Console | None) -> Console:
    # The terminal's width, or rich's 80 columns when the output is piped: every table below is built
    # to fit that without wrapping a row (free text is cut with an ellipsis instead).
    return console if console is not None else Console(soft_wrap=False)


_COLOURS = {"good": "green", "fair": "yellow", "poor": "red"}


def _headline(label: str, ett_pct: float | None) -> Text:
    colour = _COLOURS[ett_grade(ett_pct)]
    return Text.assemble(
        (label, "bold"),
        (f"{ett_text(ett_pct):>6}", f"bold {colour}"),
        "  ",
        (_bar((ett_pct or 0.0) / 100, 30), colour),
    )


def _table(
    out: Console,
    title: str | None,
    columns: Sequence[tuple[str, str]],
    rows: Sequence[Sequence[str | Text]],
    free: int | None = None,
) -> None:
    """Print a table whose rows never wrap: each column as wide as its widest cell, and the ``free``
    column (free text: a failure's reason, a run directory) cut with an ellipsis to the width left."""
    table = Table(title=title, title_justify="left", show_edge=False, header_style="bold")
    widths = [max([len(name)] + [_cells(row[i]) for row in rows]) for i, (name, _) in enumerate(columns)]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    if free is not None:
        # Each column has a space either side and a rule between it and the next.
        fixed = sum(w + 2 for i, w in enumerate(widths) if i != free) + len(columns) - 1
        table.columns[free].max_width = max(8, out.width - fixed - 2)
    for row in rows:
        table.add_row(*row)
    out.print(table)


def _cells(cell: str | Text) -> int:
    """Terminal cells ``cell`` takes (a bar's block characters count one each)."""
    return (cell if isinstance(cell, Text) else Text(cell)).cell_len


# -- terminal ------------------------------------------------------------------------------------------


def print_run(result: RunResult, console: Console | None = None) -> None:
    """Print one run: ETT% large, the L1 figures, the L2 buckets, the attempts, the ranks."""
    out = _console(console)
    _print_headline(result, out)
    _print_l1(result, out)
    _print_buckets(result, out)
    _print_attempts(result, out)
    _print_ranks(result, out)
    if result.slow_steps is not None and result.slow_steps.measured_steps:
        print_slow_steps(result, out)
    _print_compile_switches(result, out)
    if result.windows is not None:
        print_windows(result.windows, out)


def _print_headline(result: RunResult, out: Console) -> None:
    facts = Text(
        f"end-to-end {format_duration(result.e2e_s)} · {result.devices} device(s) · "
        f"{len(result.attempts)} attempt(s) · {result.l1['failures']} failure(s)",
        style="dim",
    )
    out.print(
        Panel(
            Group(_headline("ETT ", result.ett_pct), facts),
            title=f"[bold]{result.job}[/]",
            subtitle=result.run_dir,
            expand=False,
        )
    )


def _print_l1(result: RunResult, out: Console) -> None:
    by_cat = ", ".join(f"{k} {v}" for k, v in result.l1["failures_by_category"].items())
    _table(
        out,
        "L1: where the time went",
        (("figure", "left"), ("time", "right"), ("% of e2e", "right")),
        [(label, format_duration(result.l1[key]), pct_text(result.l1[key], result.e2e_s)) for key, label in L1_LABELS]
        + [("failures", str(result.l1["failures"]), by_cat)],
    )


def _print_buckets(result: RunResult, out: Console) -> None:
    e2e = result.e2e_s
    held = [(name, seconds) for name, seconds in result.buckets.items() if seconds > 0]
    rows: list[Sequence[str | Text]] = [
        (
            Text(name, style=_bucket_style(name)),
            f"{seconds:,.2f}",
            pct_text(seconds, e2e),
            _bar(seconds / e2e if e2e else 0),
        )
        for name, seconds in held
    ]
    rows.append((Text("end-to-end", style="bold"), f"{e2e:,.2f}", "100.0%", ""))
    _table(
        out,
        "L2: buckets (they sum to end-to-end)",
        (("bucket", "left"), ("seconds", "right"), ("%", "right"), ("", "left")),
        rows,
    )
    if len(held) < len(result.buckets):
        out.print(f"[dim]{len(result.buckets) - len(held)} empty bucket(s) hidden; --json lists all[/]")


def _bucket_style(name: str) -> str:
    return "green" if name == EFFECTIVE else "red" if name in (LOST, RECOVERY) else ""


def _print_attempts(result: RunResult, out: Console) -> None:
    # A single attempt that ran to its end has nothing to add to the figures above.
    if len(result.attempts) > 1 or any(a.failed for a in result.attempts):
        _attempts_table(result, out)
    forked = [str(a.attempt) for a in result.attempts if a.forked]
    if forked:
        out.print(f"[dim]forked from a preloader (no new interpreter): attempt {', '.join(forked)}[/]")


def _attempts_table(result: RunResult, out: Console) -> None:
    _table(
        out,
        "attempts (start-up: before the first step; waited: to be rescheduled)",
        (
            ("#", "left"),
            ("wall", "right"),
            ("start-up", "right"),
            ("waited", "right"),
            ("steps", "right"),
            ("lost", "right"),
            ("ETT%", "right"),
            ("ended by", "left"),
        ),
        [
            (
                str(a.attempt),
                format_duration(a.e2e_s),
                format_duration(a.pre_first_step_s),
                format_duration(a.recovery_wait_s),
                f"{a.steps:,}",
                format_duration(a.buckets[LOST]),
                ett_text(a.ett_pct).rstrip("%"),
                "train_end" if a.failure is None else f"{a.failure['category']}: {a.failure['reason']}",
            )
            for a in result.attempts
        ],
        free=7,
    )


def _print_ranks(result: RunResult, out: Console) -> None:
    if len(result.ranks) > 1:
        _table(
            out,
            "ranks",
            (("rank", "left"), ("ETT%", "right"), ("largest other bucket", "left")),
            rank_rows(result.ranks, EFFECTIVE),
            free=2,
        )


def _print_compile_switches(result: RunResult, out: Console) -> None:
    if result.compile_switches:
        _table(
            out,
            SWITCH_TITLE,
            [(c, "left" if c == "switched at" else "right") for c in SWITCH_COLUMNS],
            [switch_row(s) for s in result.compile_switches],
            free=2,
        )


def print_windows(windows: Sequence[Window | FleetWindow], console: Console | None = None) -> None:
    """Print a series of time windows: start (local time), length, counted time, ETT%, the largest
    other bucket and the failures. Fleet windows count device-hours and add the number of jobs."""
    import datetime as dt

    out = _console(console)
    fleet = any(isinstance(w, FleetWindow) for w in windows)
    offset = dt.datetime.now().astimezone().strftime("%z")
    columns = [
        ("since", "left"),
        ("length", "right"),
        *([("device-h", "right"), ("jobs", "right")] if fleet else [("counted", "right")]),
        ("ETT%", "right"),
        ("largest other bucket", "left"),
        ("failures", "right"),
    ]
    rows = []
    for w in windows:
        counted = sum(w.buckets.values())
        others = {k: v for k, v in w.buckets.items() if k != EFFECTIVE and v > 0}
        worst = max(others, key=others.__getitem__) if others else None
        ett = "-" if w.ett_pct is None else f"{w.ett_pct:.1f}"
        row = [dt.datetime.fromtimestamp(w.since).strftime("%m-%d %H:%M:%S"), format_duration(w.until - w.since)]
        row += (
            [f"{counted / 3600:,.2f}", f"{w.jobs:,}", ett]
            if isinstance(w, FleetWindow)
            else [format_duration(counted), ett]
        )
        row += [f"{worst} {pct_text(others[worst], counted)}" if worst else "-", str(w.failures)]
        rows.append(row)
    _table(out, f"windows (local time, UTC{offset}; excluded time not counted)", columns, rows, free=len(columns) - 2)


def print_slow_steps(result: RunResult, console: Console | None = None, top: int = 5) -> None:
    """Print the slow-steps diagnostic: ideal step time, time lost to slow steps, the slowest steps and
    the ranks the others waited for."""
    out = _console(console)
    slow = result.slow_steps
    if slow is None or slow.ideal_step_s is None or slow.slow_above_s is None:
        return
    ideal, slow_above = slow.ideal_step_s, slow.slow_above_s
    for line in slow_summary(slow, ideal, slow_above, result.e2e_s).split("; "):
        out.print(Text(line, style="bold"))
    if slow.slowest_steps:
        _table(
            out,
            "slowest steps",
            [(col, "right") for col in ("attempt", "step", "duration", "over ideal")],
            [
                (str(s.attempt), f"{s.step:,}", step_time(s.duration_s), step_time(s.excess_s))
                for s in slow.slowest_steps[:top]
            ],
        )
    for s in slow.interrupted:
        out.print(
            f"[dim]step {s.step:,} of attempt {s.attempt} was running at the failure, "
            f"{step_time(s.running_s)} in (not timed)[/]"
        )
    if len(result.ranks) < 2:
        return
    if not slow.slowest_ranks:
        out.print(
            f"[dim]stragglers: none (no rank's step ended more than "
            f"{step_time(slow_above - ideal)} after all the others')[/]"
        )
        return
    _table(
        out,
        "stragglers: ranks whose step ended after every other rank's",
        tuple(zip(STRAGGLER_COLUMNS, ("right", "right", "right", "left"), strict=True)),
        [
            (
                str(r.rank),
                f"{r.lagged_steps:,}",
                format_duration(r.lag_s),
                ", ".join(f"{lag.attempt}/{lag.step}: {step_time(lag.lag_s)}" for lag in r.worst[:3]),
            )
            for r in slow.slowest_ranks[:top]
        ],
        free=3,
    )
    out.print(f"[dim]{LAG_NOTE}[/]")


def print_fleet(fleet: FleetResult, console: Console | None = None, top: int = 20) -> None:
    """Print fleet ETT%, the device-second weighted buckets and the jobs with the lowest ETT%."""
    out = _console(console)
    total = fleet.device_seconds
    out.print(
        Panel(
            Group(
                _headline("fleet ETT ", fleet.ett_pct),
                Text(
                    f"{fleet.jobs:,} job(s) · {total / 3600:,.1f} device-hours · {fleet.failures:,} failure(s)",
                    style="dim",
                ),
            ),
            title="[bold]fleet[/] (weighted by device-seconds)",
            expand=False,
        )
    )
    _table(
        out,
        "buckets (device-hours)",
        (("bucket", "left"), ("device-hours", "right"), ("%", "right"), ("", "left")),
        [
            (name, f"{seconds / 3600:,.2f}", pct_text(seconds, total), _bar(seconds / total if total else 0))
            for name, seconds in fleet.to_dict()["buckets"].items()
            if seconds > 0
        ],
    )
    worst = sorted(fleet.runs, key=lambda r: r["ett_pct"])[:top]
    _table(
        out,
        f"lowest ETT% ({len(worst)} of {fleet.jobs:,})",
        (
            ("job", "left"),
            ("devices", "right"),
            ("wall", "right"),
            ("ETT%", "right"),
            ("failures", "right"),
            ("run dir", "left"),
        ),
        [
            (
                r["job"],
                str(r["devices"]),
                format_duration(r["e2e_s"]),
                f"{r['ett_pct']:.1f}",
                str(r["failures"]),
                r["run_dir"],
            )
            for r in worst
        ],
        free=5,
    )
    if fleet.windows is not None:
        print_windows(fleet.windows, out)


def print_interval(advice: IntervalAdvice, console: Console | None = None) -> None:
    """Print the advised checkpoint interval and the waste at it."""
    out = _console(console)
    rows = [
        ("blocking per checkpoint", format_duration(advice.blocking_s)),
        ("failures per day", f"{advice.failures_per_day:g}"),
        ("mean time between failures", format_duration(advice.mtbf_s)),
        ("advised interval", format_duration(advice.interval_s)),
        ("waste at it", f"{advice.waste_pct:.2f}% ({advice.blocked_pct:.2f}% blocked + {advice.lost_pct:.2f}% lost)"),
    ]
    if advice.current_interval_s is not None:
        rows.append(
            (f"waste at current {format_duration(advice.current_interval_s)}", f"{advice.current_waste_pct:.2f}%")
        )
    _table(
        out, "checkpoint interval (first-order optimum sqrt(2·MTBF·blocking))", (("", "left"), ("value", "right")), rows
    )
    if not advice.first_order_valid:
        out.print(
            "[yellow]warning:[/] the interval is not small against the time between failures; the "
            "first-order model is rough here"
        )


_LOST_FROM = {
    "run": "as its failures lost",
    "model": "interval / 2 + detection",
    "snapshots": "snapshot steps / 2 + detection",
    "attempt": "its attempt: no checkpoint",
}

#: What the projection assumes, printed under its figures.
PROJECTION_ASSUMPTIONS = (
    "The model: one start-up and one shutdown per job, at the run's costs (start-up does not grow with "
    "devices); each failure costs one recovery at the run's cost and loses the progress since the last "
    "checkpoint, half an interval plus detection on average (without a committed checkpoint, all its "
    "attempt trained); failures are independent, at one rate per device-hour whatever their category; "
    "each interval of loop time blocks once on a checkpoint. At the run's own scale its failures lose "
    "what they lost and its saves block as they did, so the projection reproduces the measured ETT%."
)


def print_projections(projections: Sequence[Projection], console: Console | None = None) -> None:
    """Print projections side by side: one column per run, the projected figures, then the inputs, and
    under them the model's assumptions and what each run's projection rests on."""
    out = _console(console)
    if not projections:
        return
    _table(
        out,
        _projection_title(projections),
        [("", "left"), *[(_projection_header(p), "right") for p in projections]],
        [
            (Text(label, style=style), *[Text(cell(p), style=style) for p in projections])
            for label, cell, style in _PROJECTION_ROWS
        ],
    )
    out.print(f"[dim]{PROJECTION_ASSUMPTIONS}[/]")
    for p in projections:
        _print_projection_notes(p, out)


def _projection_header(p: Projection) -> str:
    return p.costs.job if p.snapshot_every is None else f"{p.costs.job} + snapshots"


def _snapshot_cell(p: Projection) -> str:
    if p.snapshot_every is None:
        return "-"
    return f"every {p.snapshot_every} step{'s' if p.snapshot_every > 1 else ''}"


def _projection_title(projections: Sequence[Projection]) -> str:
    # One scale for every column goes in the title; the run's own scale differs per run.
    scales = {(p.devices, round(p.days, 6)) for p in projections}
    if len(scales) == 1 and not any(p.failures_from == "run" for p in projections):
        return f"ETT% projected to {projections[0].devices:,} devices x {projections[0].days:g} days"
    return "ETT% projected"


def _mtbf_cell(p: Projection) -> str:
    return "-" if p.mtbf_h is None else format_duration(p.mtbf_h * 3600)


def _interval_cell(p: Projection) -> str:
    if p.checkpoint_interval_s is None:
        return "-"
    return f"{format_duration(p.checkpoint_interval_s)} ({p.interval_from})"


def _model_lost_cell(p: Projection) -> str:
    return "-" if p.model_lost_per_failure_s is None else format_duration(p.model_lost_per_failure_s)


def _l1_cell(key: str) -> Callable[[Projection], str]:
    return lambda p: f"{format_duration(p.l1[key])} ({pct_text(p.l1[key], p.e2e_s)})"


#: The rows of the projection table: label, the cell of one projection, style. The projected figures
#: first, then what they rest on (dim).
_PROJECTION_ROWS: tuple[tuple[str, Callable[[Projection], str], str], ...] = (
    ("projected ETT%", lambda p: f"{p.projected_ett_pct:.2f}", "bold"),
    ("measured ETT% (the run)", lambda p: f"{p.costs.ett_pct:.2f}", ""),
    ("devices", lambda p: f"{p.devices:,}", ""),
    ("end-to-end", lambda p: format_duration(p.e2e_s), ""),
    ("failures", lambda p: f"{p.failures:,.1f} ({p.failures_from})", ""),
    ("mean time between failures", _mtbf_cell, ""),
    ("checkpoint interval", _interval_cell, ""),
    ("per-step snapshots", _snapshot_cell, ""),
    *[(label, _l1_cell(key), "") for key, label in L1_LABELS],
    ("per start (measured)", lambda p: format_duration(p.costs.start_s), "dim"),
    ("per recovery", lambda p: format_duration(p.recovery_s), "dim"),
    ("lost per failure", lambda p: format_duration(p.lost_per_failure_s), "dim"),
    ("  from", lambda p: _LOST_FROM[p.lost_from], "dim"),
    ("  the model's", _model_lost_cell, "dim"),
    ("blocking per checkpoint", lambda p: step_time(p.costs.blocking_s), "dim"),
)


def _print_projection_notes(p: Projection, out: Console) -> None:
    if p.lost_from == "attempt" and p.failures:
        out.print(
            f"[yellow]note:[/] {p.costs.job} committed no checkpoint: each failure loses all its attempt "
            "trained, so the job keeps about the training after its last failure (give "
            "--checkpoint-interval to project it with checkpoints)"
        )
    if not p.first_order_valid:
        out.print(
            f"[yellow]warning:[/] {p.costs.job}: the checkpoint interval is not small against the time "
            f"between failures; the first-order model is rough here"
        )


def results_json(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """The ``warmstart ett report --json`` payload: one object per run."""
    return [r.to_dict() for r in results]
