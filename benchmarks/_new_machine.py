"""What the compile benchmarks share: a brand-new "machine" for a job, and how they end."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "compile_job.py"
MACHINE = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def machine_env(machine: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a job on a brand-new machine under ``machine``: empty HOME, TMPDIR and
    Inductor, Triton and warmstart directories, no inherited warmstart or Inductor settings."""
    for sub in ("home", "tmp", "inductor", "triton", "warmstart", "runs"):
        (machine / sub).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHINDUCTOR", "TORCH_COMPILE"))}
    env.update(
        HOME=str(machine / "home"),
        TMPDIR=str(machine / "tmp"),
        TORCHINDUCTOR_CACHE_DIR=str(machine / "inductor"),
        TRITON_CACHE_DIR=str(machine / "triton"),
        WARMSTART_CACHE_DIR=str(machine / "warmstart"),
        WARMSTART_RUN_DIR=str(machine / "runs"),
        **extra,
    )
    return env


def run_job(machine: Path, model: str, env: dict[str, str], job_args=(), prefix=()) -> dict:
    """``compile_job.py --model model`` on a new machine under ``machine`` (run under ``prefix``, a
    command such as ``ip netns exec NAME``): its ``RESULT`` and ``wall_s``. Raises on failure."""
    start = time.perf_counter()
    proc = subprocess.run(
        [*prefix, sys.executable, str(JOB), "--model", model, *job_args],
        env=machine_env(machine, env),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{model} on {machine.name} failed:\n{proc.stderr[-3000:]}")
    return {**job_result(proc.stdout), "wall_s": wall}


def job_result(stdout: str) -> dict:
    """The job's ``RESULT`` line."""
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])


def finish(console, tables: list, out: dict, json_path: str | None) -> None:
    """Print the tables and the machine; write every figure to ``json_path`` when given."""
    for table in tables:
        console.print(table)
    console.print(f"machine: {out['machine']}")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))


def store_figures() -> dict:
    """In a job: warmstart's store stats and counters (``store``, ``counters``), or nothing when
    warmstart is off or has no store. Background writes are flushed first."""
    from warmstart.config import job_identity

    if not job_identity().enabled:  # not Settings: a bad cache setting must not fail the job, only turn the cache off
        return {}
    from warmstart.compile_cache import get_store

    store = get_store()
    if store is None:
        return {}
    store.flush(timeout=30)
    return {"store": store.stats.to_dict(), "counters": store.stats.counters_dict()}
