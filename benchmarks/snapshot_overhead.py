"""Per-step snapshots: training step time with and without them, on the reference job, in one run.

The reference job (``warmstart.bench.reference_job``, DLRM-style TorchRec model, 2 ranks under
torchrun, gloo, CPU) runs in warmstart mode without a failure, alternately with ``--snapshots off``
and ``on`` (``--rounds`` times each, so that drift of the machine hits both alike), at each table
scale of ``--scales`` (1: the reference tables; 10: every table 10x more rows). With snapshots on,
the node keeper copies each snapshot to a buddy keeper on TCP, as in ``warmstart bench
cold-vs-warm`` (``--no-buddy``: the node keeper only). The step time of a run is the median of
rank 0's step-to-step intervals after the first ``--skip`` steps (from its ETT events); the ratio
is on / off, medians over the rounds. Rows touched and bytes sent per step come from the ranks'
``snapshots-r*.json`` reports. Usage::

    python benchmarks/snapshot_overhead.py [--steps 200] [--rounds 2] [--scales 1,10] [--no-buddy] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from warmstart.bench.supervise import start_snapshot_buddy, stop_snapshot_keepers


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skip", type=int, default=20, help="first steps left out of the step time")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--scales", default="1,10", help="table row multipliers, comma-separated")
    p.add_argument("--no-buddy", action="store_true", help="snapshots kept by the node's keeper only")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def _run(work: Path, name: str, scale: int, snapshots: bool, steps: int, env: dict[str, str], with_buddy: bool) -> Path:
    """One job; returns its run directory."""
    run_dir = work / name / "runs"
    tmp = Path(tempfile.mkdtemp(prefix="ws-so-", dir="/tmp"))
    env = {**env, "WARMSTART_RUN_DIR": str(run_dir), "WARMSTART_JOB_ID": name, "TMPDIR": str(tmp)}
    buddy_pid = None
    (work / name).mkdir(parents=True, exist_ok=True)
    args = ["--steps", str(steps), "--snapshots", "on" if snapshots else "off"]
    args += ["--rows-min", str(1_000 * scale), "--rows-max", str(8_000 * scale)]
    args += ["--checkpoint-dir", str(work / name / "ckpt"), "--checkpoint-every", str(max(steps // 4, 1))]
    try:
        if snapshots and with_buddy:
            buddy, buddy_pid = start_snapshot_buddy(env, work / name / "buddy.log")
            args += ["--snapshot-buddy", buddy]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        cmd += ["-m", "warmstart.bench.reference_job", "--mode", "warmstart", *args]
        log = work / name / "job.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{name}: exit status {done.returncode} (log: {log})")
    finally:
        if buddy_pid is not None:
            os.kill(buddy_pid, 9)
        stop_snapshot_keepers(None, tmp.parent, work / name, pattern=f"{tmp.name}/warmstart-keeper.sock")
        shutil.rmtree(tmp, ignore_errors=True)
    return run_dir


def _step_s(run_dir: Path, skip: int) -> float:
    from warmstart.metrics import read_events

    steps = [
        (e.step, e.ts)  # type: ignore[attr-defined]
        for path in run_dir.glob("events-r0-a*.jsonl")
        for e in read_events(path)
        if e.event == "step"
    ]
    ts = [t for step, t in sorted(steps) if step >= skip]
    return statistics.median(b - a for a, b in zip(ts, ts[1:], strict=False))


def _snapshot_figures(run_dir: Path) -> dict[str, float]:
    reports = [json.loads(p.read_text()) for p in run_dir.glob("snapshots-r*-a*.json")]
    taken = sum(r["taken"] for r in reports)
    return {
        "rows_per_step": sum(r["rows_per_step"] * r["taken"] for r in reports) / taken,
        "bytes_per_step": sum(r["bytes_per_step"] * r["taken"] for r in reports) / taken,
        "capture_ms_per_step": 1000 * sum(r["capture_s"] for r in reports) / taken,
        "copy_wait_ms_per_step": 1000 * sum(r.get("wait_s", 0.0) for r in reports) / taken,
        "skipped": sum(r["skipped"] for r in reports),
    }


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    work = Path(tempfile.mkdtemp(prefix="warmstart-snapshot-overhead-"))
    cache = work / "cache"
    cache.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHELASTIC"))}
    # the compile cache on (a local tier shared by the runs), so every run after the first skips the compile
    key = work / "secret"
    key.write_text("snapshot-overhead-benchmark")
    env.update(
        WARMSTART="1",
        WARMSTART_CACHE_DIR=str(cache),
        WARMSTART_SECRET_FILE=str(key),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    results = []
    try:
        for scale in (int(s) for s in args.scales.split(",")):
            off, on, figures = [], [], []
            for r in range(args.rounds):
                for snapshots in (False, True):
                    name = f"x{scale}-{'on' if snapshots else 'off'}-{r}"
                    run_dir = _run(work, name, scale, snapshots, args.steps, env, not args.no_buddy)
                    step = _step_s(run_dir, args.skip)
                    (on if snapshots else off).append(step)
                    if snapshots:
                        figures.append(_snapshot_figures(run_dir))
                    print(f"{name}: {1000 * step:.1f} ms/step", flush=True)
            row = {
                "tables_scale": scale,
                "step_ms_off": 1000 * statistics.median(off),
                "step_ms_on": 1000 * statistics.median(on),
                "ratio": statistics.median(on) / statistics.median(off),
                **{k: statistics.mean(f[k] for f in figures) for k in figures[0]},
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    where = "node keeper only" if args.no_buddy else "node keeper and a buddy keeper on TCP"
    print(f"\nsnapshot overhead (reference job, 2 ranks, {args.steps} steps, {args.rounds} rounds, {where})")
    head = f"{'tables':>7} {'off ms/step':>12} {'on ms/step':>11} {'on/off':>7} {'rows/step':>10} {'MB/step':>8}"
    print(f"{head} {'capture ms':>11} {'copy wait ms':>13}")
    for row in results:
        print(
            f"{row['tables_scale']:>6}x {row['step_ms_off']:>12.1f} {row['step_ms_on']:>11.1f} {row['ratio']:>7.3f} "
            f"{row['rows_per_step']:>10.0f} {row['bytes_per_step'] / 1e6:>8.2f} {row['capture_ms_per_step']:>11.1f}"
            f" {row['copy_wait_ms_per_step']:>13.1f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"machine": platform.platform(), "buddy": not args.no_buddy, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
