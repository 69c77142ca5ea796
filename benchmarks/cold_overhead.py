"""What warmstart costs a cold compile: each model compiled (forward and backward, plus the first step)
on brand-new "machines" with an empty cache, in three configurations, interleaved:

* ``torch``: no warmstart;
* ``warmstart, local``: ``WARMSTART=1`` with the local tier only;
* ``warmstart, remote``: ``WARMSTART=1`` with an empty remote tier too (a real redis-server, the
  writer's Ed25519 key).

Figures per run: ``compile_s`` (the job's compile plus first step, as in the other compile
benchmarks), its CPU seconds (the job and its g++ children), the CPU seconds of warmstart's own
background threads during it, and the process's whole wall time (start-up, imports, and the exit,
where queued writes are flushed).

Each round runs the three configurations one after the other, in a rotating order, so that each
round gives a ratio of runs that saw the same machine: the table shows the median of the rounds'
ratios, and their spread (lowest and highest), which says how far to trust it. Usage::

    python benchmarks/cold_overhead.py [--models mlp,conv,attention] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _new_machine import JOB, MACHINE, finish, job_result, machine_env

CONFIGS = ("torch", "warmstart, local", "warmstart, remote")


def run(machine: Path, model: str, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(JOB), "--model", model],
        env=machine_env(machine, env),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{model} on {machine.name} failed:\n{proc.stderr[-3000:]}")
    result = job_result(proc.stdout)
    result["wall_s"] = wall
    return result


def _paired(runs: dict[str, list[dict]], name: str, figure: str) -> dict:
    ratios = sorted(a[figure] / b[figure] for a, b in zip(runs[name], runs["torch"], strict=True))
    return {"median": statistics.median(ratios), "low": ratios[0], "high": ratios[-1]}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per configuration, the median over rounds of its ratio to plain torch in the same round."""
    local, remote = CONFIGS[1], CONFIGS[2]
    return {
        "torch_compile_s": statistics.median(x["compile_s"] for x in runs["torch"]),
        "local_over_torch": _paired(runs, local, "compile_s"),
        "remote_over_torch": _paired(runs, remote, "compile_s"),
        "cpu_local_over_torch": _paired(runs, local, "compile_cpu_s"),
        "cpu_remote_over_torch": _paired(runs, remote, "compile_cpu_s"),
        "wall_local_over_torch": _paired(runs, local, "wall_s"),
        "wall_remote_over_torch": _paired(runs, remote, "wall_s"),
        "threads_cpu_s": {
            n: statistics.median(x.get("warmstart_threads_cpu_s", 0.0) for x in runs[n]) for n in (local, remote)
        },
        "same_loss": all(x["losses"] == runs["torch"][0]["losses"] for n in CONFIGS for x in runs[n]),
    }


def _ratio_cell(r: dict) -> str:
    return f"{r['median']:.3f}x ({r['low']:.2f}-{r['high']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,conv,attention")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from _redis import RedisNode

    from warmstart.compile_cache.signing import generate_key_pair

    console = Console(width=160)
    work = Path(tempfile.mkdtemp(prefix="ws-bench-cold-"))
    generate_key_pair(work / "signing.key", work / "verify.pub")
    out: dict = {"machine": MACHINE, "models": {}}
    with console.status("") as status:
        for model in args.models.split(","):
            runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
            for r in range(args.repeats):
                node = RedisNode(work / f"redis-{model}-{r}").start()  # empty for every round
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
                    order = CONFIGS[r % 3 :] + CONFIGS[: r % 3]
                    for name in order:
                        status.update(f"{model}: {name} ({r + 1}/{args.repeats})")
                        machine = work / f"{model}-{name.replace(', ', '-')}-{r}"
                        runs[name].append(run(machine, model, envs[name]))
                finally:
                    node.stop()
            out["models"][model] = runs

    table = Table(
        title=f"cold compile + first step: median of {args.repeats} rounds' ratios (lowest-highest)",
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
    for model, runs in out["models"].items():
        summary = summarize(runs)
        out["models"][model] = {"runs": runs, "summary": summary}
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
