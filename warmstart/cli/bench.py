"""``warmstart bench cold-vs-warm``: the main job (docs/reference.md#the-main-job) from the command line.

A thin layer over :mod:`warmstart.bench.cold_vs_warm`: options, a progress display while the three
configurations run, the side-by-side table, and the ``--json`` / ``--html`` files.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click

from warmstart.checkpoint.mode import AsyncMode
from warmstart.cli._output import print_table

if TYPE_CHECKING:  # the bench modules load when the command runs, not with the CLI
    from warmstart.bench.cold_vs_warm import BenchOptions, ConfigResult


@click.group()
def group() -> None:
    """Benchmarks of warmstart on the reference TorchRec training job.

    \b
    Example:
      warmstart bench cold-vs-warm --json demo.json --html demo.html
    """


@group.command("cold-vs-warm")
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the figures of baseline, cold and warm (and the ratios) to this file.",
)
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a self-contained page: the figures side by side, then each run's breakdown and timeline.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=4),
    default=120,
    show_default=True,
    help="Training steps of each job (across its restart).",
)
@click.option("--tables", type=click.IntRange(min=1), default=64, show_default=True, help="Embedding tables.")
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Samples per step and rank."
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=None,
    help="Steps between checkpoints.  [default: steps / 4]",
)
@click.option(
    "--fail-at-step",
    type=click.IntRange(min=1),
    default=None,
    help="Step at which the first attempt dies.  [default: 5/8 of the steps]",
)
@click.option(
    "--checkpoint-mode",
    type=click.Choice([mode.value for mode in AsyncMode]),
    default=AsyncMode.ASYNC.value,
    show_default=True,
    help="How warmstart saves checkpoints (cold, warm).",
)
@click.option(
    "--snapshots/--no-snapshots",
    default=True,
    show_default=True,
    help="Cold and warm hand a snapshot of each step to their node's keeper and a buddy's, and resume "
    "from the step they failed in (--no-snapshots: from their last checkpoint, as the baseline).",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where machines, checkpoints, run directories and logs go.  [default: a temporary folder]",
)
@click.option(
    "--keep/--no-keep",
    default=False,
    show_default=True,
    help="Keep the work dir (always kept when --work-dir is given).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=10),
    default=900.0,
    show_default=True,
    help="Seconds one configuration may run before it is stopped.",
)
@click.option(
    "--stall-timeout",
    "stall_timeout_s",
    type=click.FloatRange(min=1),
    default=180.0,
    show_default=True,
    help="Seconds a configuration may record no new ETT event before it is stopped (its ranks' "
    "Python stacks are dumped into its log first).",
)
@click.option(
    "--no-preload", is_flag=True, help="Run warm on machines without a preloader: every rank starts a new interpreter."
)
@click.option(
    "--compile",
    "compile_mode",
    type=click.Choice(["inline", "background"]),
    default="inline",
    show_default=True,
    help="How cold and warm compile (WARMSTART_COMPILE): background trains eagerly while a compile "
    "worker fills the cache, then switches.",
)
def cold_vs_warm(
    json_file,
    html_file,
    steps,
    tables,
    batch_size,
    checkpoint_every,
    fail_at_step,
    checkpoint_mode,
    snapshots,
    work_dir,
    keep,
    timeout_s,
    stall_timeout_s,
    no_preload,
    compile_mode,
) -> None:
    """Run the reference job as baseline, cold and warm, each on fresh machines, and compare.

    baseline: no warmstart. cold: warmstart on, a throwaway `warmstart server` that starts empty.
    warm: the same server, filled by cold, on machines that run a preloader (warmstart preload) as a
    node service, started before their attempt (--no-preload: without). --compile background: cold
    and warm train eagerly while a compile worker compiles, then switch. Every job has 2 ranks under
    torchrun, fails once and restarts on a new machine (fresh local directories), and resumes from
    its last checkpoint; cold and warm from the last step a buddy node's keeper holds (their per-step
    snapshots; --no-snapshots: from their last checkpoint too).

    \b
    Example:
      warmstart bench cold-vs-warm --json demo.json --html demo.html
      warmstart bench cold-vs-warm --steps 60 --tables 64 --work-dir /tmp/bench --keep
    """
    from warmstart.bench.cold_vs_warm import BenchOptions, summary
    from warmstart.bench.config import JobConfig
    from warmstart.bench.page import render_page, table_rows

    checkpoint_every = checkpoint_every or max(1, steps // 4)
    fail_at_step = fail_at_step if fail_at_step is not None else (steps * 5) // 8
    if fail_at_step >= steps:
        raise click.BadParameter(f"{fail_at_step} is not below --steps ({steps})", param_hint="--fail-at-step")
    if checkpoint_every > fail_at_step:
        raise click.BadParameter(
            f"{checkpoint_every} is above --fail-at-step ({fail_at_step}): the restart "
            "would have no checkpoint to resume from",
            param_hint="--checkpoint-every",
        )
    job = JobConfig(
        steps=steps,
        tables=tables,
        batch_size=batch_size,
        checkpoint_every=checkpoint_every,
        fail_at_step=fail_at_step,
        checkpoint_mode=checkpoint_mode,
        snapshots=snapshots,
    )
    temporary = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="warmstart-bench-")) if temporary else work_dir
    options = BenchOptions(
        job=job,
        work_dir=work,
        timeout_s=timeout_s,
        stall_timeout_s=stall_timeout_s,
        preload=not no_preload,
        compile_mode=compile_mode,
    )
    try:
        results = _run_with_progress(options)
        if temporary and not keep:
            # The work dir (machines, checkpoints) goes; the small event files stay where
            # `warmstart ett report` users look for them.
            for res in results.values():
                kept = Path("warmstart-runs") / res.result.job
                shutil.copytree(res.run_dir, kept, dirs_exist_ok=True)
                res.run_dir = kept
                res.result.run_dir = str(kept)
            click.echo("event files: " + " ".join(str(r.run_dir) for r in results.values()), err=True)
        out = summary(results, options)
        print_table(
            "warmstart bench cold-vs-warm (reference TorchRec job, 2 ranks, 1 failure + restart)",
            ["figure", "baseline", "cold", "warm", "warm / baseline"],
            table_rows(results),
        )
        if json_file:
            json_file.write_text(json.dumps(out, indent=2) + "\n")
            click.echo(f"wrote {json_file}", err=True)
        if html_file:
            html_file.write_text(render_page(results))
            click.echo(f"wrote {html_file}", err=True)
    finally:
        if temporary and not keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            click.echo(f"work dir: {work}", err=True)


def _run_with_progress(options: BenchOptions) -> dict[str, ConfigResult]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from warmstart.bench.cold_vs_warm import CONFIGS, run_cold_vs_warm

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file or a pipe: one line per change of phase, no redraws
        last: dict[str, str] = {}

        def log_line(config: str, phase: str, step: int, total: int) -> None:
            if last.get(config) != phase:
                last[config] = phase
                click.echo(f"{config}: {phase} (step {step}/{total})", err=True)

        return run_cold_vs_warm(options, log_line)

    columns = (
        TextColumn("{task.fields[config]:<8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        tasks = {name: bar.add_task("waiting", total=options.job.steps, config=name, start=False) for name in CONFIGS}
        started: set[str] = set()

        def progress(config: str, phase: str, step: int, total: int) -> None:
            if config not in started:
                bar.start_task(tasks[config])
                started.add(config)
            bar.update(tasks[config], description=phase, completed=step)
            if phase == "done":
                bar.stop_task(tasks[config])

        return run_cold_vs_warm(options, progress)
