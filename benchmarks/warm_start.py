"""Where a warm start's time goes: compile + first step split into torch's own phases, for each
configuration, each on a brand-new "machine" unless said otherwise:

* ``cold``: nothing cached, no warmstart;
* ``torch local-warm``: the cold machine again (torch's own local caches warm);
* ``warmstart``: warmstart with its default settings (compiled frames off: Dynamo traces, every
  compiled artifact comes from the cache), the shared cache filled by a producer machine;
* ``warmstart, frames on``: warmstart with ``WARMSTART_DYNAMO=1`` (Dynamo's output stored and
  installed instead of tracing), the same shared cache;
* ``warmstart, preloaded``: ``warmstart`` on a new machine that runs a preloader (``warmstart
  preload``, started when the machine is brought up, its start-up outside the figures): the job
  forks from it instead of starting a new interpreter. The last table counts the imports too.

Two producers (new machines) fill the shared cache once per model, one with default settings and
one with frames on: with frames on, AOTAutograd bundles the compiled graphs into its own entries
(torch's ``bundled_autograd_cache``, part of its cache keys), so each configuration finds what a
fleet of its own setting would have stored.
Phases come from torch's ``dynamo_timed`` timers (see ``torch_phases`` in ``compile_job.py``): Dynamo
tracing, guard building, the backend (AOTAutograd and Inductor: on a warm start, cache lookups and
loads), frames loaded from a precompile package, and the rest (the first forward and backward).
Warm configurations run ``--repeats`` times, interleaved; a table row is the run with the median
total, so its phases add up. Usage::

    python benchmarks/warm_start.py [--models mlp,conv,attention,encoder] [--repeats 3] [--no-preimport]
                                    [--json FILE]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _new_machine import MACHINE, finish, machine_env, run_job

CONFIGS = ("cold", "torch local-warm", "warmstart", "warmstart, frames on", "warmstart, preloaded")
WARM = CONFIGS[1:]
SUMMARY = ("torch local-warm", "warmstart", "warmstart, frames on")  # the summary's columns
PHASES = (
    ("dynamo_tracing", "Dynamo tracing"),
    ("guards", "guards"),
    ("backend", "backend load/lookups"),
    ("precompile_load", "precompile load"),
    ("first_run_and_rest", "first run/rest"),
)


def run(machine: Path, model: str, env: dict[str, str], job_args: list[str]) -> dict:
    return run_job(machine, model, env, job_args)


def run_preloaded(machine: Path, model: str, env: dict[str, str], job_args: list[str]) -> dict:
    """``run`` on a machine brought up with a preloader serving the job's environment there."""
    from warmstart.preload import control

    start = time.perf_counter()
    info = control.start(environ=machine_env(machine, env))
    preload_start_s = time.perf_counter() - start
    try:
        result = run(machine, model, env, job_args)
    finally:
        control.stop(info["socket"])
    return {**result, "preload_start_s": preload_start_s}


def bench_model(model: str, work: Path, ws: dict[str, str], job_args: list[str], progress, repeats: int) -> dict:
    frames_on = {**ws, "WARMSTART_DYNAMO": "1"}
    results: dict = {}
    progress(f"{model}: cold")
    results["cold"] = [run(work / f"{model}-cold", model, {}, job_args)]
    progress(f"{model}: producer fills the shared cache (another new machine)")
    results["producer"] = [run(work / f"{model}-producer", model, ws, job_args)]
    progress(f"{model}: producer with frames on (another new machine)")
    results["producer, frames on"] = [run(work / f"{model}-producer-frames-on", model, frames_on, job_args)]
    warm = {
        "torch local-warm": lambda r: run(work / f"{model}-cold", model, {}, job_args),
        "warmstart": lambda r: run(work / f"{model}-ws{r}", model, ws, job_args),
        "warmstart, frames on": lambda r: run(work / f"{model}-frames-on{r}", model, frames_on, job_args),
        "warmstart, preloaded": lambda r: run_preloaded(work / f"{model}-preloaded{r}", model, ws, job_args),
    }
    # Interleaved, so that a slow spell on this shared machine does not fall on one configuration.
    for r in range(repeats):
        for name, step in warm.items():
            progress(f"{model}: {name} ({r + 1}/{repeats})")
            results.setdefault(name, []).append(step(r))
    return results


def median_run(runs: list[dict]) -> dict:
    """The run with the median compile_s (the lower one of an even count)."""
    ordered = sorted(runs, key=lambda x: x["compile_s"])
    return ordered[(len(ordered) - 1) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,conv,attention,encoder")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each warm configuration (median reported)")
    parser.add_argument(
        "--no-preimport",
        action="store_true",
        help="jobs load torch's compiler modules inside the clock (shown as 'of which imports')",
    )
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    from _redis import RedisNode
    from rich.console import Console
    from rich.table import Table

    from warmstart.compile_cache.signing import generate_key_pair

    console = Console(width=160)
    job_args = ["--no-preimport"] if args.no_preimport else []
    work = Path(tempfile.mkdtemp(prefix="ws-bench-warm-start-"))
    key_file = work / "signing.key"
    generate_key_pair(key_file, work / "verify.pub")
    node = RedisNode(work / "redis").start()
    ws = {"WARMSTART": "1", "WARMSTART_CACHE_URL": node.url, "WARMSTART_KEY_FILE": str(key_file)}  # Ed25519
    out: dict = {"machine": MACHINE, "repeats": args.repeats, "preimport": not args.no_preimport, "models": {}}
    try:
        with console.status("") as status:
            for model in args.models.split(","):
                out["models"][model] = bench_model(
                    model, work, ws, job_args, lambda msg: status.update(f"compiling {msg}"), args.repeats
                )
    finally:
        node.stop()
        shutil.rmtree(work, ignore_errors=True)

    tables = []
    for model, r in out["models"].items():
        table = Table(
            title=f"{model}: compile + first step (forward and backward), seconds; warm configurations: "
            f"the run with the median total of {args.repeats}",
            title_justify="left",
        )
        table.add_column("configuration")
        table.add_column("total s", justify="right")
        for _, label in PHASES:
            table.add_column(label, justify="right")
        if args.no_preimport:
            table.add_column("of which imports", justify="right")
        table.add_column("modules loaded", justify="right")
        r["breakdown"] = {}
        for name in CONFIGS:
            x = median_run(r[name])
            phases = x["phases"]
            r["breakdown"][name] = {
                "compile_s": x["compile_s"],
                **{k: phases[k] for k, _ in PHASES},
                "compiler_import": phases.get("compiler_import"),
                "modules_loaded": x["modules_loaded"]["during_compile"],
            }
            row = [name, f"{x['compile_s']:.2f}", *[f"{phases[k]:.2f}" for k, _ in PHASES]]
            if args.no_preimport:
                row.append(f"{phases.get('compiler_import', 0.0):.2f}")
            row.append(str(x["modules_loaded"]["during_compile"]))
            table.add_row(*row)
        tables.append(table)

    summary = Table(
        title=f"summary: compile + first step, seconds, median of {args.repeats}; shared cache filled by "
        "producers with frames on and off",
        title_justify="left",
    )
    for column in ("model", "local-warm s", "ws s", "ws frames on s", "ws / local-warm", "frames on / local-warm"):
        summary.add_column(column, justify="left" if column == "model" else "right")
    summary.add_column("same loss", justify="center")
    for model, r in out["models"].items():
        t = {name: statistics.median(x["compile_s"] for x in r[name]) for name in SUMMARY}
        same = all(x["losses"] == r["cold"][0]["losses"] for name in WARM for x in r[name])
        r["summary"] = {
            "seconds": t,
            "ws_over_local_warm": t["warmstart"] / t["torch local-warm"],
            "frames_on_over_local_warm": t["warmstart, frames on"] / t["torch local-warm"],
            "same_loss": same,
        }
        summary.add_row(
            model,
            *[f"{t[n]:.2f}" for n in SUMMARY],
            f"{r['summary']['ws_over_local_warm']:.2f}x",
            f"{r['summary']['frames_on_over_local_warm']:.2f}x",
            "yes" if same else "NO",
        )
    tables.append(summary)
    starts = Table(
        title=f"the whole start: torch imported, compiler imported, compile + first step; seconds, median "
        f"of {args.repeats}",
        title_justify="left",
    )
    for column in (
        "model",
        "ws: imports s",
        "ws: total s",
        "preloaded: imports s",
        "preloaded: total s",
        "preloaded / ws",
        "preloader start-up s (apart)",
    ):
        starts.add_column(column, justify="left" if column == "model" else "right")
    for model, r in out["models"].items():
        totals = {}
        for name in ("warmstart", "warmstart, preloaded"):
            imports = statistics.median(x["import_s"] + x["compiler_import_s"] for x in r[name])
            total = statistics.median(x["import_s"] + x["compiler_import_s"] + x["compile_s"] for x in r[name])
            totals[name] = (imports, total)
        startup = statistics.median(x["preload_start_s"] for x in r["warmstart, preloaded"])
        r["whole_start"] = {
            "imports_s": {n: v[0] for n, v in totals.items()},
            "total_s": {n: v[1] for n, v in totals.items()},
            "preloaded_over_ws": totals["warmstart, preloaded"][1] / totals["warmstart"][1],
            "preload_start_s": startup,
        }
        starts.add_row(
            model,
            f"{totals['warmstart'][0]:.2f}",
            f"{totals['warmstart'][1]:.2f}",
            f"{totals['warmstart, preloaded'][0]:.2f}",
            f"{totals['warmstart, preloaded'][1]:.2f}",
            f"{r['whole_start']['preloaded_over_ws']:.2f}x",
            f"{startup:.1f}",
        )
    tables.append(starts)
    finish(console, tables, out, args.json)


if __name__ == "__main__":
    main()
