"""What warmstart costs a cold compile: each model compiled (forward and backward, plus the first step)
on brand-new "machines" with an empty cache, in three configurations:

* ``torch``: no warmstart;
* ``warmstart, local``: ``WARMSTART=1`` with the local tier only;
* ``warmstart, remote``: ``WARMSTART=1`` with an empty remote tier too (a real redis-server, the
  writer's Ed25519 key).

Figures per run: ``compile_s`` (the job's compile plus first step, as in the other compile
benchmarks), its CPU seconds (the job and its g++ children), the CPU seconds of warmstart's own
background threads during it, and the process's whole wall time (start-up, imports, and the exit,
where queued writes are flushed).

Every figure is a ratio of two runs that saw the same machine, taken in one of two ways:

* ``--mode pinned`` (the default): a warmstart run and a torch run at the same time, each held to a
  core of its own (its g++ children and warmstart's threads included), the cores swapped every
  round. Both runs meet the same moments of a shared, noisy machine, so a pair's ratio spreads by a
  few percent where runs one after the other spread by 15-40%; and warmstart's background work has
  no idle core to hide on: it competes with its own compile.
* ``--mode sequential``: the three configurations one after the other, in a rotating order, each
  with every core.

The table shows the median of the rounds' ratios and a 95% bootstrap interval of that median, which
says how far to trust it. Usage::

    python benchmarks/cold_overhead.py [--models mlp,conv,attention] [--repeats 8] [--mode pinned|sequential]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _new_machine import JOB, MACHINE, finish, job_result, machine_env

CONFIGS = ("torch", "warmstart, local", "warmstart, remote")


def run(machine: Path, model: str, env: dict[str, str], cpu: int | None = None) -> dict:
    """One job, held to core ``cpu`` (its g++ children too) when given, else with every core."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(JOB), "--model", model],
        env=machine_env(machine, env),
        capture_output=True,
        text=True,
        timeout=1800,
        preexec_fn=None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu})),
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{model} on {machine.name} failed:\n{proc.stderr[-3000:]}")
    result = job_result(proc.stdout)
    result["wall_s"] = wall
    return result


def run_pinned(jobs: list[tuple[Path, dict[str, str]]], model: str) -> list[dict]:
    """The jobs at the same time, the i-th held to core i."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, machine, model, env, cpu) for cpu, (machine, env) in enumerate(jobs)]
        return [f.result() for f in futures]


def _paired(pairs: list[tuple[dict, dict]], figure: str) -> dict:
    """The median over ``pairs`` (a warmstart run, the torch run it is compared with) of their ratio."""
    ratios = sorted(ws[figure] / torch[figure] for ws, torch in pairs)
    low_ci, high_ci = _median_interval(ratios)
    return {
        "median": statistics.median(ratios),
        "low": ratios[0],
        "high": ratios[-1],
        "ci95": [low_ci, high_ci],
    }


def _median_interval(values: list[float], resamples: int = 4000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values``: how far the rounds' median can be trusted
    on a machine whose runs spread."""
    rng = random.Random(0)  # the same figures give the same interval
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def summarize(pairs: dict[str, list[tuple[dict, dict]]]) -> dict:
    """Per warmstart configuration, the median over rounds of its ratio to the torch run beside it."""
    local, remote = CONFIGS[1], CONFIGS[2]
    torch_runs = [t for name in (local, remote) for _, t in pairs[name]]
    every_run = torch_runs + [w for name in (local, remote) for w, _ in pairs[name]]
    return {
        "torch_compile_s": statistics.median(x["compile_s"] for x in torch_runs),
        "local_over_torch": _paired(pairs[local], "compile_s"),
        "remote_over_torch": _paired(pairs[remote], "compile_s"),
        "cpu_local_over_torch": _paired(pairs[local], "compile_cpu_s"),
        "cpu_remote_over_torch": _paired(pairs[remote], "compile_cpu_s"),
        "wall_local_over_torch": _paired(pairs[local], "wall_s"),
        "wall_remote_over_torch": _paired(pairs[remote], "wall_s"),
        "threads_cpu_s": {
            n: statistics.median(w.get("warmstart_threads_cpu_s", 0.0) for w, _ in pairs[n]) for n in (local, remote)
        },
        "same_loss": all(x["losses"] == torch_runs[0]["losses"] for x in every_run),
    }


def measure(model: str, rounds: int, mode: str, work: Path, status) -> dict[str, list[tuple[dict, dict]]]:
    """``rounds`` rounds of ``model``: per warmstart configuration, (its run, the torch run it is compared with)."""
    from _redis import RedisNode

    pairs: dict[str, list[tuple[dict, dict]]] = {name: [] for name in CONFIGS[1:]}
    for r in range(rounds):
        round_dir = work / f"{model}-{r}"  # removed after the round: a round's machines take ~3 GB
        node = RedisNode(round_dir / "redis").start()  # empty for every round
        try:
            envs = {
                "torch": {},
                "warmstart, local": {"WARMSTART": "1"},
                "warmstart, remote": {
                    "WARMSTART": "1",
                    "WARMSTART_CACHE_URL": node.url,
                    "WARMSTART_KEY_FILE": str(work / "signing.key"),
                },
            }

            def machine(name: str, tag: str = "", round_dir: Path = round_dir) -> Path:
                return round_dir / f"{name.replace(', ', '-')}{tag}"

            if mode == "pinned":
                for name in CONFIGS[1:]:
                    status.update(f"{model}: {name} beside torch ({r + 1}/{rounds})")
                    jobs = [(machine(name), envs[name]), (machine("torch", "-beside-" + name.split()[-1]), {})]
                    swap = r % 2 == 1  # the cores swap every round
                    ws_run, torch_run = run_pinned(jobs[::-1] if swap else jobs, model)[:: -1 if swap else 1]
                    pairs[name].append((ws_run, torch_run))
            else:
                results = {}
                for name in CONFIGS[r % 3 :] + CONFIGS[: r % 3]:
                    status.update(f"{model}: {name} ({r + 1}/{rounds})")
                    results[name] = run(machine(name), model, envs[name])
                for name in CONFIGS[1:]:
                    pairs[name].append((results[name], results["torch"]))
        finally:
            node.stop()
            shutil.rmtree(round_dir, ignore_errors=True)
    return pairs


def _ratio_cell(r: dict) -> str:
    return f"{r['median']:.3f}x ({r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,conv,attention")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--mode", choices=("pinned", "sequential"), default="pinned")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.mode == "pinned" and len(os.sched_getaffinity(0)) < 2:
        parser.error("--mode pinned needs two cores; use --mode sequential")
    from rich.console import Console
    from rich.table import Table

    from warmstart.compile_cache.signing import generate_key_pair

    console = Console(width=160)
    work = Path(tempfile.mkdtemp(prefix="ws-bench-cold-"))
    generate_key_pair(work / "signing.key", work / "verify.pub")
    out: dict = {"machine": MACHINE, "mode": args.mode, "models": {}}
    try:
        with console.status("") as status:
            for model in args.models.split(","):
                out["models"][model] = measure(model, args.repeats, args.mode, work, status)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(
        title=f"cold compile + first step ({args.mode}): "
        f"median of {args.repeats} rounds' ratios (95% bootstrap interval)",
        title_justify="left",
    )
    for column in (
        "model",
        "torch s",
        "local / torch",
        "remote / torch",
        "CPU: local / torch",
        "CPU: remote / torch",
        "warmstart threads CPU s (local, remote)",
        "wall: local / torch",
        "wall: remote / torch",
        "same loss",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model, pairs in out["models"].items():
        summary = summarize(pairs)
        out["models"][model] = {"pairs": pairs, "summary": summary}
        table.add_row(
            model,
            f"{summary['torch_compile_s']:.2f}",
            *[
                _ratio_cell(summary[k])
                for k in ("local_over_torch", "remote_over_torch", "cpu_local_over_torch", "cpu_remote_over_torch")
            ],
            f"{summary['threads_cpu_s']['warmstart, local']:.2f}, {summary['threads_cpu_s']['warmstart, remote']:.2f}",
            _ratio_cell(summary["wall_local_over_torch"]),
            _ratio_cell(summary["wall_remote_over_torch"]),
            "yes" if summary["same_loss"] else "NO",
        )
    finish(console, [table], out, args.json)


if __name__ == "__main__":
    main()
