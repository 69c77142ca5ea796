"""What torchrun's restart costs, with and without warmstart in torchrun's own process.

One job under ``torchrun --standalone --nproc-per-node=1 --max-restarts=1 --monitor-interval=0.1``
whose first worker exits with status 1 as soon as it starts; the figure is the time from the first
worker's start to the second's (torchrun noticing the failure, stopping the worker group, the
rendezvous, starting the new worker). Without warmstart, torch's c10d rendezvous waits a random
0-0.3 s before that first restart's rejoin; with ``WARMSTART=1`` in torchrun's environment it rejoins
at once. The worker imports nothing and starts as a new interpreter in both (``WARMSTART_PRELOAD=0``).
The rounds alternate, each a new torchrun.

Usage::

    python benchmarks/torchrun_restart.py [--rounds 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _new_machine import MACHINE, finish

_WORKER = r"""
import os, sys, time
with open(os.environ["RESTART_LOG"], "a") as f:
    f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {time.time()!r}\n")
sys.exit(1 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
"""


def _restart_s(work: Path, warmstart: bool) -> float:
    log = work / f"restarts-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHELASTIC"))}
    env.update(RESTART_LOG=str(log), WARMSTART_PRELOAD="0", WARMSTART_CACHE_DIR=str(work / "cache"))
    if warmstart:
        env["WARMSTART"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        str(work / "worker.py"),
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)
    starts = dict(line.split() for line in log.read_text().splitlines())
    return float(starts["1"]) - float(starts["0"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    out: dict = {"machine": MACHINE, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="ws-bench-restart-") as tmp:
        work = Path(tmp)
        (work / "worker.py").write_text(_WORKER)
        with console.status("restarts") as status:
            for i in range(args.rounds):
                status.update(f"round {i + 1} of {args.rounds}")
                without = _restart_s(work, warmstart=False)
                with_ws = _restart_s(work, warmstart=True)
                out["rounds"].append({"without": without, "with": with_ws, "ratio": with_ws / without})

    table = Table(title="torchrun's restart: first worker's start to the second's, seconds", title_justify="left")
    for column in ("round", "without warmstart", "WARMSTART=1", "ratio"):
        table.add_column(column, justify="right")
    for i, r in enumerate(out["rounds"], 1):
        table.add_row(str(i), f"{r['without']:.3f}", f"{r['with']:.3f}", f"{r['ratio']:.3f}x")
    for name in ("without", "with"):
        out[f"mean_{name}_s"] = statistics.mean(r[name] for r in out["rounds"])
    out["median_ratio"] = statistics.median(r["ratio"] for r in out["rounds"])
    table.add_row(
        "mean / median ratio",
        f"{out['mean_without_s']:.3f}",
        f"{out['mean_with_s']:.3f}",
        f"{out['median_ratio']:.3f}x",
        style="bold",
    )
    finish(console, [table], out, args.json)


if __name__ == "__main__":
    main()
