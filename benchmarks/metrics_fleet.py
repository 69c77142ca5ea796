"""`warmstart ett fleet` over 1,000 run directories (one job each, 1 to 64 devices, 1 to 3
attempts, about 1,000 events, 1 s steps).

    .venv/bin/python benchmarks/metrics_fleet.py [--runs 1000] [--steps 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _metrics_data import write_run


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        events = sum(
            write_run(
                root / f"job-{i:04d}",
                f"job-{i:04d}",
                args.steps,
                attempts=1 + i % 3,
                devices=2 ** (i % 7),
                seed=i,
                step_s=1.0,
            )
            for i in range(args.runs)
        )
        exe = Path(sys.executable).with_name("warmstart")
        dirs = sorted(str(p) for p in root.iterdir())
        for label, argv in ((f"{len(dirs):,} RUN_DIR arguments", dirs), ("one parent directory", [str(root)])):
            cpu = _children_cpu()
            start = time.perf_counter()
            proc = subprocess.run([str(exe), "ett", "fleet", *argv, "--json"], capture_output=True, text=True)
            wall = time.perf_counter() - start
            assert proc.returncode == 0, proc.stderr
            fleet = json.loads(proc.stdout)
            print(
                f"warmstart ett fleet ({label}): {fleet['jobs']:,} jobs, {events:,} events: {wall:.2f} s wall, "
                f"{_children_cpu() - cpu:.2f} s CPU; fleet ETT {fleet['ett_pct']:.1f}%"
            )


if __name__ == "__main__":
    main()
