"""``warmstart ett``: ETT% of runs (``report``), of a fleet (``fleet``) and the checkpoint-interval
advisor (``interval``). A thin layer over ``warmstart.metrics``; output formats live in its ``report``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import click

from warmstart.cli._output import emit_json, json_option
from warmstart.metrics.advisor import advise_interval
from warmstart.metrics.calculator import RunResult, compute, load_runs
from warmstart.metrics.events import EventFormatError
from warmstart.metrics.fleet import FleetResult
from warmstart.metrics.report import print_fleet, print_interval, print_run, render_html, results_json


class _BadInput(click.ClickException):
    """Unreadable or malformed event files: bad input, exit code 2."""

    exit_code = 2


def _results(run_dirs: Sequence[Path], progress: bool = False) -> Iterator[RunResult]:
    """Compute each run directory's jobs, one directory at a time (events are dropped after)."""
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
            for run in runs:
                result = compute(run)
                for note in result.warnings:
                    click.echo(f"warmstart: warning: {note}", err=True)
                yield result
            bar.advance(task)


@click.group(name="ett")
def group() -> None:
    """Effective Training Time (ETT%): the share of wall time that trained on new data.

    \b
    Example:
      warmstart ett report warmstart-runs/job-1 --html ett.html
      warmstart ett fleet warmstart-runs/*
      warmstart ett interval --blocking 30 --failures-per-day 2
    """


@group.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@json_option
@click.option("--html", "html_file", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="Also write a self-contained HTML page with the timeline and breakdown charts.")
def report(run_dirs: tuple[Path, ...], as_json: bool, html_file: Path | None) -> None:
    """ETT% of each run with its two-level breakdown (L1 figures, L2 buckets).

    RUN_DIR holds the run's *.jsonl event files (docs/reference.md#events), searched recursively.

    \b
    Example:
      warmstart ett report warmstart-runs/job-1
      warmstart ett report warmstart-runs/job-1 --json
    """
    results = list(_results(run_dirs))
    if html_file is not None:
        try:
            html_file.write_text(render_html(results), encoding="utf-8")
        except OSError as exc:
            raise click.ClickException(f"cannot write {html_file}: {exc.strerror}") from None
        click.echo(f"warmstart: wrote {html_file}", err=True)
    if as_json:
        emit_json(results_json(results))
        return
    for result in results:
        print_run(result)


@group.command("fleet")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@json_option
def fleet(run_dirs: tuple[Path, ...], as_json: bool) -> None:
    """Fleet ETT%, weighted by device-seconds, over many runs.

    A directory holding several jobs' events (e.g. warmstart-runs/) counts each job.

    \b
    Example:
      warmstart ett fleet warmstart-runs/*
      warmstart ett fleet warmstart-runs --json
    """
    total = FleetResult()
    for result in _results(run_dirs, progress=True):
        total.add(result)
    if as_json:
        emit_json(total.to_dict())
    else:
        print_fleet(total)


@group.command("interval")
@click.option("--blocking", "blocking_s", type=float, required=True,
              help="Seconds one checkpoint blocks training.")
@click.option("--failures-per-day", type=float, required=True, help="Failures (any kind) per day of training.")
@click.option("--current", "current_s", type=float, default=None,
              help="The checkpoint interval in use (seconds), to compare its waste.")
@json_option
def interval(blocking_s: float, failures_per_day: float, current_s: float | None, as_json: bool) -> None:
    """The checkpoint interval that minimises blocked plus lost time, and the waste at it.

    interval = sqrt(2 * MTBF * blocking) with MTBF = 86400 / failures-per-day;
    waste = blocking / interval + interval / (2 * MTBF).

    \b
    Example:
      warmstart ett interval --blocking 30 --failures-per-day 2
    """
    advice = advise_interval(blocking_s, failures_per_day, current_s)
    if as_json:
        emit_json(advice.to_dict())
    else:
        print_interval(advice)
