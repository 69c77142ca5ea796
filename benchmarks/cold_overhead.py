"""What warmstart costs a cold compile: each model compiled (forward and backward, plus the first step)
on brand-new "machines" with an empty cache, in three configurations, interleaved:

* ``torch``: no warmstart;
* ``warmstart, local``: ``WARMSTART=1`` with the local tier only;
* ``warmstart, remote``: ``WARMSTART=1`` with an empty remote tier too (a real redis-server, the
  writer's Ed25519 key).

Two figures per run: ``compile_s`` (the job's compile plus first step, as in the other compile
benchmarks) and the process's whole wall time (start-up, imports, and the exit, where queued remote
writes are flushed). Medians over ``--repeats`` rounds; each round runs the three configurations one
after the other, in a rotating order. Usage::

    python benchmarks/cold_overhead.py [--models mlp,conv,attention] [--repeats 3] [--json FILE]
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

from _new_machine import JOB, MACHINE, finish, job_result, machine_env  # noqa: E402

CONFIGS = ("torch", "warmstart, local", "warmstart, remote")


def run(machine: Path, model: str, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(JOB), "--model", model], env=machine_env(machine, env),
                          capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{model} on {machine.name} failed:\n{proc.stderr[-3000:]}")
    result = job_result(proc.stdout)
    result["wall_s"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,conv,attention")
    parser.add_argument("--repeats", type=int, default=3)
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
                    envs = {"torch": {}, "warmstart, local": {"WARMSTART": "1"},
                            "warmstart, remote": {"WARMSTART": "1", "WARMSTART_CACHE_URL": node.url,
                                                  "WARMSTART_KEY_FILE": str(work / "signing.key")}}
                    order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
                    for name in order:
                        status.update(f"{model}: {name} ({r + 1}/{args.repeats})")
                        machine = work / f"{model}-{name.replace(', ', '-')}-{r}"
                        runs[name].append(run(machine, model, envs[name]))
                finally:
                    node.stop()
            out["models"][model] = runs

    table = Table(title=f"cold compile + first step, and the whole process, seconds: median of {args.repeats}",
                  title_justify="left")
    for column in ("model", *(f"{n} s" for n in CONFIGS), "local / torch", "remote / torch",
                   "wall: local / torch", "wall: remote / torch", "same loss"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model, runs in out["models"].items():
        t = {n: statistics.median(x["compile_s"] for x in runs[n]) for n in CONFIGS}
        w = {n: statistics.median(x["wall_s"] for x in runs[n]) for n in CONFIGS}
        same = all(x["losses"] == runs["torch"][0]["losses"] for n in CONFIGS for x in runs[n])
        summary = {"compile_s": t, "wall_s": w, "local_over_torch": t["warmstart, local"] / t["torch"],
                   "remote_over_torch": t["warmstart, remote"] / t["torch"],
                   "wall_local_over_torch": w["warmstart, local"] / w["torch"],
                   "wall_remote_over_torch": w["warmstart, remote"] / w["torch"], "same_loss": same}
        out["models"][model] = {"runs": runs, "summary": summary}
        table.add_row(model, *[f"{t[n]:.2f}" for n in CONFIGS], f"{summary['local_over_torch']:.3f}x",
                      f"{summary['remote_over_torch']:.3f}x", f"{summary['wall_local_over_torch']:.3f}x",
                      f"{summary['wall_remote_over_torch']:.3f}x", "yes" if same else "NO")
    finish(console, [table], out, args.json)


if __name__ == "__main__":
    main()
