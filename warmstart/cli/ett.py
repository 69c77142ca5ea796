"""``warmstart ett``: ETT% of runs (``report``), of a fleet (``fleet``), projected to another scale
(``project``), and the checkpoint-interval advisor (``interval``). A thin layer over
``warmstart.metrics``; output formats live in its ``report``."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import click

from warmstart.cli._output import emit_json, json_option
from warmstart.cli._windows import DURATION, every_usage_errors, time_filter, window_options
from warmstart.metrics.advisor import advise_interval
from warmstart.metrics.calculator import RunResult, compute, load_runs
from warmstart.metrics.event_files import event_files
from warmstart.metrics.events import EventFormatError
from warmstart.metrics.fleet import FleetResult
from warmstart.metrics.projection import ProjectionError, Scale, measure, project
from warmstart.metrics.report import print_fleet, print_interval, print_projections, print_run, results_json
from warmstart.metrics.report_html import render_fleet_html, render_html
from warmstart.metrics.windows import FleetWindow, FleetWindows, TimeFilter, apply, default_every


class _BadInput(click.ClickException):
    """Unreadable or malformed event files: bad input, exit code 2."""

    exit_code = 2


def _results(
    run_dirs: Sequence[Path],
    progress: bool = False,
    time: TimeFilter | None = None,
    segments: bool = False,
    skip_empty: bool = False,
) -> Iterator[RunResult]:
    """Compute each run directory's jobs, one directory at a time (events are dropped after); with
    ``time``, restricted and sliced by it. ``segments``: keep each job's segments even without ``time``.

    A directory without any event is bad input: it is no run, and a report of it would show a job at
    0%. ``skip_empty`` (a fleet over ``runs/*``) warns and goes on instead, and only a fleet without a
    single event is bad input."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=not (progress and console.is_terminal)) as bar:
        task = bar.add_task("reading run directories", total=len(run_dirs))
        for run_dir in run_dirs:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torn lines come back in result.warnings
                    runs = load_runs([run_dir])
            except EventFormatError as exc:
                raise _BadInput(str(exc)) from None
            if not any(run.events for run in runs):
                what = _no_events(run_dir)
                if not skip_empty:
                    raise _BadInput(what)
                click.echo(f"warmstart: warning: {what}; left out", err=True)
                bar.advance(task)
                continue
            for run in runs:
                result = compute(run, segments=segments or time is not None)
                if time is not None:
                    with every_usage_errors():
                        result = apply(result, time)
                for note in result.warnings:
                    click.echo(f"warmstart: warning: {note}", err=True)
                yield result
            bar.advance(task)


def _no_events(run_dir: Path) -> str:
    found = "its *.jsonl files hold no events" if event_files(run_dir) else "it holds no *.jsonl files"
    return f"{run_dir}: no ETT events: {found} (expected a run directory of event files, docs/reference.md#events)"


@click.group(name="ett")
def group() -> None:
    """Effective Training Time (ETT%): the share of wall time that trained on new data.

    \b
    Example:
      warmstart ett report warmstart-runs/job-1 --html ett.html
      warmstart ett fleet warmstart-runs/*
      warmstart ett interval --blocking 30 --failures-per-day 2
      warmstart ett project warmstart-runs/job-1 --devices 1024 --days 7
    """


@group.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@json_option
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Also write a self-contained HTML page with the timeline and breakdown charts.",
)
@window_options
def report(
    run_dirs: tuple[Path, ...],
    as_json: bool,
    html_file: Path | None,
    since: float | None,
    until: float | None,
    every: float | None,
    exclude: tuple[tuple[float, float], ...],
) -> None:
    """ETT% of each run with its two-level breakdown (L1 figures, L2 buckets).

    RUN_DIR holds the run's *.jsonl event files (docs/reference.md#events), searched recursively.
    --since/--until/--exclude restrict the totals to that time; --every adds the ETT% of each window.

    \b
    Example:
      warmstart ett report warmstart-runs/job-1
      warmstart ett report warmstart-runs/job-1 --json
      warmstart ett report warmstart-runs/job-1 --every 1h --exclude 2024-05-01T02:00Z..2024-05-01T03:00Z
    """
    results = list(_results(run_dirs, time=time_filter(since, until, every, exclude)))
    if html_file is not None:
        _write_page(html_file, render_html(results))
    if as_json:
        emit_json(results_json(results))
        return
    for result in results:
        print_run(result)


@group.command("fleet")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@json_option
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Also write a self-contained HTML page: fleet ETT% over time and the jobs that lost the most.",
)
@window_options
def fleet(
    run_dirs: tuple[Path, ...],
    as_json: bool,
    html_file: Path | None,
    since: float | None,
    until: float | None,
    every: float | None,
    exclude: tuple[tuple[float, float], ...],
) -> None:
    """Fleet ETT%, weighted by device-seconds, over many runs.

    A directory holding several jobs' events (e.g. warmstart-runs/) counts each job.
    --since/--until/--exclude restrict the totals to that time; --every adds the fleet ETT% of each
    window (windows start at --since, else on multiples of DURATION since the unix epoch). The --html
    page charts the windows of --every, else 20 to 100 windows of a round length fitted to the fleet's span.

    \b
    Example:
      warmstart ett fleet warmstart-runs/*
      warmstart ett fleet warmstart-runs --json
      warmstart ett fleet warmstart-runs --since 2024-05-01T00:00Z --every 1d
      warmstart ett fleet warmstart-runs --html fleet.html
    """
    time = time_filter(since, until, every, exclude)
    total = FleetResult()
    series = FleetWindows(time) if time is not None and time.every is not None else None
    # Without --every the page's windows are sized to the fleet's span, known only once every job is
    # read: until then each job's segments are held (--every folds them one job at a time instead).
    held: list[RunResult] | None = [] if html_file is not None and series is None else None
    # Each job is restricted here; the fleet's windows are cut on one grid for all jobs, below.
    restrict_only = None if time is None else dataclasses.replace(time, every=None)
    seen = False
    for result in _results(run_dirs, progress=True, time=restrict_only, segments=held is not None, skip_empty=True):
        seen = True
        total.add(result)
        if series is not None:
            with every_usage_errors():  # the jobs together may span too many windows
                series.add(result)
        if held is not None and result.attempts:
            held.append(dataclasses.replace(result, timeline=[], rank_segments={}, ranks={}, slow_steps=None))
    if not seen:
        raise _BadInput(
            f"no ETT events in {', '.join(map(str, run_dirs))} (expected run directories of *.jsonl "
            "event files, docs/reference.md#events)"
        )
    if series is not None:
        with every_usage_errors():
            total.windows = series.windows()
    if html_file is not None:
        windows = total.windows if held is None else _fitted_windows(held, time)
        _write_page(html_file, render_fleet_html(total, windows=windows))
    if as_json:
        emit_json(total.to_dict())
    else:
        print_fleet(total)


def _fitted_windows(results: Sequence[RunResult], time: TimeFilter | None) -> list[FleetWindow]:
    """The fleet's windows at :func:`default_every`'s length for the span of ``results`` (or of
    --since/--until), lined up as ``FleetWindows`` lines them up."""
    if not results:
        return []
    time = time or TimeFilter()
    since = min(r.start_ts for r in results) if time.since is None else time.since
    until = max(r.end_ts for r in results) if time.until is None else time.until
    origin = 0.0 if time.since is None else time.since
    series = FleetWindows(dataclasses.replace(time, every=default_every(since, until, origin)))
    for result in results:
        series.add(result)
    return series.windows()


def _write_page(path: Path, page: str) -> None:
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        # A path the user gave that cannot be written is bad input (exit 2), as an unwritable
        # server --dir is.
        raise _BadInput(
            f"--html {path}: cannot write it ({exc.strerror}): expected a path to a writable file"
        ) from None
    from plotly.offline import get_plotlyjs

    # Most of a page is plotly.js (4.8 MB with plotly 7.1), inlined once so that it opens without a network.
    size, library = len(page.encode()), len(get_plotlyjs().encode())
    click.echo(
        f"warmstart: wrote {path} ({size / 1e6:.1f} MB, of which {library / 1e6:.1f} MB is plotly.js, "
        "inlined once so that the page opens without a network)",
        err=True,
    )


@group.command("interval")
@click.option(
    "--blocking",
    "blocking_s",
    type=DURATION,
    required=True,
    help="How long one checkpoint blocks training: 30s, 2m, 1h30m (a bare number is seconds).",
)
@click.option("--failures-per-day", type=float, required=True, help="Failures (any kind) per day of training.")
@click.option(
    "--current",
    "current_s",
    type=DURATION,
    default=None,
    help="The checkpoint interval in use (30m, 1h; a bare number is seconds), to compare its waste.",
)
@json_option
def interval(blocking_s: float, failures_per_day: float, current_s: float | None, as_json: bool) -> None:
    """The checkpoint interval that minimises blocked plus lost time, and the waste at it.

    interval = sqrt(2 * MTBF * blocking) with MTBF = 86400 / failures-per-day;
    waste = blocking / interval + interval / (2 * MTBF).

    \b
    Example:
      warmstart ett interval --blocking 30s --failures-per-day 2 --current 1h
    """
    advice = advise_interval(blocking_s, failures_per_day, current_s)
    if as_json:
        emit_json(advice.to_dict())
    else:
        print_interval(advice)


@group.command("project")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--devices", type=int, default=None, help="Devices of the projected job (default: the run's).")
@click.option("--days", type=float, default=None, help="End-to-end days of the projected job (default: the run's).")
@click.option(
    "--mtbf-h",
    "mtbf_h",
    type=float,
    default=None,
    help="Its mean time between failures, hours (default: published figures at its size).",
)
@click.option(
    "--checkpoint-interval",
    "interval_s",
    type=DURATION,
    default=None,
    help="Its checkpoint interval: 30m, 1h (a bare number is seconds; default: the advisor's optimum).",
)
@click.option(
    "--snapshot-every",
    type=int,
    default=None,
    help="Also project each run with per-step snapshots every N steps (a failure loses N/2 steps plus "
    "detection), next to periodic checkpoints alone.",
)
@json_option
def project_cmd(
    run_dirs: tuple[Path, ...],
    devices: int | None,
    days: float | None,
    mtbf_h: float | None,
    interval_s: float | None,
    snapshot_every: int | None,
    as_json: bool,
) -> None:
    """ETT% and its breakdown projected to a job of N devices running D days, from each run's costs.

    Per job: one start and one shutdown. Per failure: one recovery and lost progress (half a
    checkpoint interval plus detection). Failures scale with devices x time. Without --devices and
    --days: the run's own size, duration, failures and interval (reproducing its measured ETT%).

    \b
    Example:
      warmstart ett project warmstart-runs/baseline-1 warmstart-runs/warm-1 --devices 1024 --days 7
      warmstart ett project warmstart-runs/job-1 --json
    """
    scale = Scale(devices=devices, days=days, mtbf_h=mtbf_h, checkpoint_interval_s=interval_s)
    scales = [scale]
    if snapshot_every is not None:
        scales.append(dataclasses.replace(scale, snapshot_every=snapshot_every))
    try:
        projections = [project(measure(result), s) for result in _results(run_dirs) for s in scales]
    except ProjectionError as exc:
        raise _BadInput(str(exc)) from None
    if as_json:
        emit_json([p.to_dict() for p in projections])
    else:
        print_projections(projections)
