"""Concurrent cold compiles: 1, 2 and 4 brand-new "machines" start the same job at the same moment
against one empty shared cache (a real redis-server), with warmstart's single-flight compiles on and,
for comparison, off (``WARMSTART_COMPILE_WAIT_S=0``: every machine compiles everything itself).

Each job compiles the models given, in order, and runs forward and backward once
(``benchmarks/compile_job.py``). Reported per configuration: wall time from start to the last job's
end, its ratio to one machine alone, and the CPU seconds all jobs spent compiling (their own and their
compilers', from the clock's start after the compiler modules are imported). Usage::

    python benchmarks/compile_concurrent.py [--models mlp,conv,attention] [--machines 1,2,4] [--json FILE]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _new_machine import JOB, MACHINE, finish, job_result, machine_env


def run_at_once(work: Path, n: int, models: list[str], extra: dict[str, str]) -> dict:
    """Start ``n`` jobs on new machines at once; wait for all. Returns wall time and per-job results."""
    args = [sys.executable, str(JOB)] + [a for m in models for a in ("--model", m)]
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            args,
            env=machine_env(work / f"machine-{i}", extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    jobs = []
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"a job failed:\n{err[-3000:]}")
        jobs.append(job_result(out))
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "jobs": jobs,
        "compile_cpu_s": sum(j["compile_cpu_s"] for j in jobs),
        "same_loss": all(j["losses"] == jobs[0]["losses"] for j in jobs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,conv,attention")
    parser.add_argument("--machines", default="1,2,4")
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    from _redis import RedisNode
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    models = args.models.split(",")
    counts = [int(n) for n in args.machines.split(",")]
    base = Path(tempfile.mkdtemp(prefix="ws-bench-concurrent-"))
    out: dict = {"machine": MACHINE, "models": models, "runs": {}}
    try:
        with console.status("") as status:
            for label, extra in (("single-flight", {}), ("each compiles", {"WARMSTART_COMPILE_WAIT_S": "0"})):
                for n in counts:
                    status.update(f"{label}: {n} machine(s) at once")
                    slug = f"{label.replace(' ', '-')}-{n}"  # g++ refuses paths with spaces in Inductor's commands
                    node = RedisNode(base / f"redis-{slug}").start()  # empty: a cold shared cache
                    try:
                        env = {"WARMSTART": "1", "WARMSTART_CACHE_URL": node.url, "WARMSTART_SECRET": "bench", **extra}
                        out["runs"][f"{label}/{n}"] = run_at_once(base / slug, n, models, env)
                    finally:
                        node.stop()
                        shutil.rmtree(base / slug, ignore_errors=True)  # n machines of ~300 MB each
    finally:
        shutil.rmtree(base, ignore_errors=True)

    table = Table(
        title=f"{len(models)} models ({', '.join(models)}) compiled at once on new machines, one empty shared cache",
        title_justify="left",
    )
    for column in (
        "configuration",
        "machines",
        "wall s",
        "vs one alone",
        "compile CPU s",
        "vs one alone",
        "waits",
        "same loss",
    ):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for label in ("single-flight", "each compiles"):
        alone = out["runs"][f"{label}/{counts[0]}"]
        for n in counts:
            r = out["runs"][f"{label}/{n}"]
            r["wall_vs_alone"] = r["wall_s"] / alone["wall_s"]
            r["cpu_vs_alone"] = r["compile_cpu_s"] / alone["compile_cpu_s"]
            waits = sum(j.get("counters", {}).get("waits", 0) for j in r["jobs"])
            table.add_row(
                label,
                str(n),
                f"{r['wall_s']:.1f}",
                f"{r['wall_vs_alone']:.2f}x",
                f"{r['compile_cpu_s']:.1f}",
                f"{r['cpu_vs_alone']:.2f}x",
                str(int(waits)),
                "yes" if r["same_loss"] else "NO",
            )
    finish(console, [table], out, args.json)


if __name__ == "__main__":
    main()
