"""`warmstart ett report` over a run of about 1 million events (wall and CPU seconds).

Times the whole command in a fresh interpreter (as a user runs it; wall and CPU seconds, since the
machine may be shared), then the same work in process split into reading (parse + validate) and
computing.

    .venv/bin/python benchmarks/metrics_report.py [--events 1000000]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _metrics_data import write_run

from warmstart.metrics.calculator import compute, load_runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        # About 1.02 events per step (checkpoints, evals); two ranks, three attempts.
        n = write_run(run_dir, "bench-job", steps=int(args.events / 2 / 1.02), ranks=2, attempts=3)
        size = sum(p.stat().st_size for p in run_dir.iterdir())
        exe = Path(sys.executable).with_name("warmstart")
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
        for flags in ([], ["--json"], ["--html", str(Path(tmp) / "report.html")]):
            cpu_before = _children_cpu()
            start = time.perf_counter()
            proc = subprocess.run([str(exe), "ett", "report", str(run_dir), *flags], capture_output=True, text=True)
            wall = time.perf_counter() - start
            assert proc.returncode == 0, proc.stderr
            print(
                f"warmstart ett report {flags[0] if flags else '(table)':8s} {n:,} events, {size / 1e6:.0f} MB: "
                f"{wall:.2f} s wall, {_children_cpu() - cpu_before:.2f} s CPU"
            )
        start = time.process_time()
        (run,) = load_runs([run_dir])
        read = time.process_time() - start
        start = time.process_time()
        result = compute(run)
        comp = time.process_time() - start
        print(
            f"in process (CPU seconds): read {read:.2f} s, compute {comp:.2f} s; ETT {result.ett_pct:.1f}%, "
            f"{len(result.attempts)} attempts, {len(result.ranks)} ranks"
        )


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
