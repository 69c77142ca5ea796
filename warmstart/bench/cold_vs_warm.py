"""The cold-vs-warm start benchmark: the reference job as baseline, cold and warm
(docs/reference.md#the-main-job).

Each configuration runs the reference job under ``torchrun`` (2 ranks, one restart allowed), and
each attempt of each configuration lands on "a new machine": a fresh ``HOME``, ``TMPDIR``,
Inductor, Triton and warmstart cache directory, made by a two-line shell launcher keyed on
``TORCHELASTIC_RESTART_COUNT`` before Python starts. The machines' ``TMPDIR`` lives under a short
directory of its own (not under the work dir), so that DataLoader workers' ``AF_UNIX`` sockets fit in
107 bytes whatever the caller's ``TMPDIR``. Only the checkpoint folder (durable storage)
and the shared cache server survive a restart, as in a fleet. ``baseline`` runs without warmstart;
``cold`` runs with warmstart on and a throwaway cache server (``warmstart.server``) that starts
empty; ``warm`` runs against the same server, filled by ``cold``. The ETT figures come from the
metrics calculator over each configuration's run directory. This module owns the orchestration:
the configurations, their environments and command lines, and the figures; the job is
``reference_job``, running and watching its processes is ``supervise``'s, the table and the page
``page``'s.

A watchdog stops a configuration that records no new ETT event for ``stall_timeout_s``: it first
has every rank dump its Python stacks into the log (the job registers ``faulthandler`` on
``SIGUSR1``), then kills the configuration and raises one line naming the configuration, the
attempt, each rank's last stage and the log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmstart.bench.config import JobConfig
from warmstart.bench.supervise import (
    BenchError,
    CacheServer,
    launcher_args,
    run_job,
    short_tmp_root,
    start_preloaders,
    start_snapshot_buddy,
    stop_preloaders,
    stop_snapshot_keepers,
)
from warmstart.config import dynamo_frames_given

CONFIGS = ("baseline", "cold", "warm")
"""The three configurations, in the order they run (``warm`` needs the cache ``cold`` filled)."""

FIGURES = (
    "time_to_start_s",
    "time_to_recover_s",
    "compile_s",
    "sharding_plan_s",
    "checkpoint_blocking_s",
    "e2e_s",
    "ett_pct",
)
"""The per-configuration figures of the table and of ``--json``, in table order
(docs/reference.md#the-main-job)."""

_JOB_MODULE = ("-m", "warmstart.bench.reference_job")

# Variables a configuration must not inherit from the caller's shell: each run sets its own.
_INHERITED_PREFIXES = ("WARMSTART", "TORCHINDUCTOR_", "TRITON_", "TORCHELASTIC_")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What ``warmstart bench cold-vs-warm`` runs."""

    job: JobConfig
    """The reference job's settings (its ``mode`` is set per configuration)."""
    work_dir: Path
    """Where every configuration's machines, checkpoints, run directories and logs go."""
    nproc: int = 2
    """Ranks per job (torchrun ``--nproc-per-node``)."""
    timeout_s: float = 900.0
    """A configuration still running after this long is stopped and the bench fails."""
    stall_timeout_s: float = 180.0
    """A configuration that records no new ETT event (its run directory's event files stop growing)
    for this long is stopped, after its ranks dumped their Python stacks into its log; the bench fails."""
    preload: bool = True
    """``warm`` runs on machines that run a preloader as a node service (``warmstart preload``): each
    machine's preloader is started when the machine is brought up, before its attempt is launched,
    as a pool's spare node has one; its start-up time is reported apart (``preload_start_s``)."""
    compile_mode: str = "inline"
    """``WARMSTART_COMPILE`` of ``cold`` and ``warm``: ``inline``, or ``background`` (train eagerly while
    a compile worker fills the cache, then switch)."""


@dataclasses.dataclass
class ConfigResult:
    """One configuration's run: where it ran and what the calculator made of it."""

    name: str
    run_dir: Path
    log_path: Path
    wall_s: float
    result: Any  # warmstart.metrics.calculator.RunResult
    startup: list[dict[str, Any]]
    """Per attempt, rank 0's start-up report (resume step, compile counters, stage timings)."""
    cache: dict[str, dict[str, int]]
    """warmstart store counters summed over the attempts that exited cleanly: kind -> hits/misses/..."""
    preload_start_s: list[float] | None = None
    """Per machine, how long its preloader took to start (outside the job's time); ``None`` without."""

    def figures(self) -> dict[str, Any]:
        """The figures of this configuration (docs/reference.md#the-main-job), plus what the test and the
        docs use."""
        r = self.result
        buckets = r.buckets
        compile_counters: dict[str, int] = {}
        for report in self.startup:
            for key, value in report.get("compile_counters", {}).items():
                compile_counters[key] = compile_counters.get(key, 0) + value
        return {
            "e2e_s": r.e2e_s,
            "ett_pct": r.ett_pct,
            "time_to_start_s": r.l1["time_to_start_s"],
            "time_to_recover_s": r.l1["time_to_recover_s"],
            "compile_s": buckets.get("compile", 0.0),
            "sharding_plan_s": buckets.get("sharding_plan", 0.0),
            "checkpoint_blocking_s": r.l1["checkpoint_blocking_s"],
            "imports_s": buckets.get("imports", 0.0),
            "preload_start_s": self.preload_start_s,
            "lost_progress_s": r.l1["lost_progress_s"],
            "failures": r.l1["failures"],
            "attempts": [
                {
                    "attempt": a.attempt,
                    "pre_first_step_s": a.pre_first_step_s,
                    "failed": a.failed,
                    "first_step": a.first_step,
                    "last_step": a.last_step,
                    "last_committed_step": a.last_committed_step,
                    "steps": a.steps,
                    "resumed": a.resumed,
                }
                for a in r.attempts
            ],
            "resumed_from_step": [rep.get("resumed_from_step") for rep in self.startup],
            "snapshots": _snapshot_figures(self.run_dir),
            "compile_counters": compile_counters,
            "cache": self.cache,
            "buckets": dict(buckets),
            "wall_s": self.wall_s,
            "run_dir": str(self.run_dir),
            "log": str(self.log_path),
        }


ProgressFn = Callable[[str, str, int, int], None]
"""``progress(config, phase, step, total_steps)``: called while a configuration runs."""


def run_cold_vs_warm(options: BenchOptions, progress: ProgressFn | None = None) -> dict[str, ConfigResult]:
    """Run baseline, cold and warm one after the other and compute their ETT figures.

    Args:
        options: what to run and where.
        progress: called with the configuration, its phase and its step as the runs go.

    Returns:
        Configuration name to its result, in ``CONFIGS`` order.

    Raises:
        BenchError: a configuration failed or timed out (its log is named).
    """
    work = options.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda *_: None)
    results: dict[str, ConfigResult] = {}
    bench_id = uuid.uuid4().hex[:8]
    report("baseline", "starting", 0, options.job.steps)
    results["baseline"] = _run_config("baseline", options, work, bench_id, None, report)
    report("cold", "starting the cache server", 0, options.job.steps)
    server = CacheServer.start(work / "cache-server")
    try:
        for name in ("cold", "warm"):
            results[name] = _run_config(name, options, work, bench_id, server, report)
    finally:
        server.stop()
    return results


def ratios(results: dict[str, ConfigResult]) -> dict[str, float | None]:
    """warm / baseline for every figure (``None`` where the baseline figure is 0)."""
    base, warm = results["baseline"].figures(), results["warm"].figures()
    return {key: (warm[key] / base[key] if base[key] else None) for key in FIGURES}


def summary(results: dict[str, ConfigResult], options: BenchOptions) -> dict[str, Any]:
    """The ``--json`` object (docs/reference.md#the-main-job): ``baseline``, ``cold``, ``warm``,
    ``warm_vs_baseline`` ratios, and the settings the figures were measured with."""
    out: dict[str, Any] = {name: res.figures() for name, res in results.items()}
    out["warm_vs_baseline"] = ratios(results)
    out["loss_vs_baseline"] = loss_differences(results)
    out["preload_start_s"] = results["warm"].preload_start_s
    job = options.job
    out["settings"] = {
        "steps": job.steps,
        "tables": job.tables,
        "batch_size": job.batch_size,
        "fail_at_step": job.fail_at_step,
        "checkpoint_every": job.checkpoint_every,
        "ranks": options.nproc,
        "checkpoint_mode": job.checkpoint_mode,
        "preload": options.preload,
        "snapshots": job.snapshots,
        "compile": options.compile_mode,
    }
    return out


def losses(run_dir: Path) -> dict[tuple[int, int], float]:
    """Each step's loss on each rank, from the ``losses-r<rank>-a<attempt>.txt`` files the reference job
    writes next to its events: ``(rank, step) -> loss``. Where a restart ran a step again (the steps a
    failed attempt ran after its last checkpoint are lost), the later attempt's loss counts."""
    found: list[tuple[int, int, Path]] = []
    for path in run_dir.glob("losses-r*-a*.txt"):
        rank_text, _, attempt_text = path.stem.removeprefix("losses-r").partition("-a")
        if rank_text.isdigit() and attempt_text.isdigit():
            found.append((int(attempt_text), int(rank_text), path))
    out: dict[tuple[int, int], float] = {}
    for _, rank, path in sorted(found):
        for line in path.read_text().splitlines():
            step_text, _, loss = line.partition(" ")
            try:
                out[(rank, int(step_text))] = float(loss)
            except ValueError:  # a line torn by the injected failure
                continue
    return out


def loss_differences(results: dict[str, ConfigResult]) -> dict[str, dict[str, Any]]:
    """How far ``cold``'s and ``warm``'s losses are from the baseline's, step by step on every rank: the
    largest absolute difference (``None`` when no step could be compared), the (rank, step) pairs
    compared and the baseline's count of them."""
    base = losses(results["baseline"].run_dir)
    out: dict[str, dict[str, Any]] = {}
    for name in CONFIGS[1:]:
        mine = losses(results[name].run_dir)
        common = base.keys() & mine.keys()
        out[name] = {
            "max_abs_diff": max((abs(mine[k] - base[k]) for k in common), default=None),
            "compared": len(common),
            "baseline": len(base),
        }
    return out


# -- one configuration ---------------------------------------------------------------------------------


def _run_config(
    name: str, options: BenchOptions, work: Path, bench_id: str, server: CacheServer | None, report: ProgressFn
) -> ConfigResult:
    from warmstart.metrics import compute_runs

    root = work / name
    if root.exists():  # a rerun in the same --work-dir: a machine is new only if its dirs are empty
        shutil.rmtree(root)
    run_dir, machines = root / "runs", root / "machines"
    run_dir.mkdir(parents=True)
    machines.mkdir()
    log_path = root / "job.log"
    job = dataclasses.replace(
        options.job, mode="baseline" if name == "baseline" else "warmstart", checkpoint_dir=root / "checkpoints"
    )
    tmp_root = short_tmp_root()
    preloaders: list[str] = []
    preload_start_s: list[float] | None = None
    buddy_pid: int | None = None
    try:
        env = _job_env(name, root, tmp_root, run_dir, bench_id, server, options.compile_mode)
        if job.mode == "warmstart" and job.snapshots:
            buddy, buddy_pid = start_snapshot_buddy(env, root / "buddy-keeper.log")
            job = dataclasses.replace(job, snapshot_buddy=buddy)
        if name == "warm" and options.preload:
            # What a user names for their own job: its trainer module, preloaded with torch and TorchRec.
            env["WARMSTART_PRELOAD_MODULES"] = "warmstart.bench.trainer"
            report(name, "bringing the machines up (their preloaders)", 0, job.steps)
            preloaders, preload_start_s = start_preloaders(env, machines, tmp_root, attempts=2)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={options.nproc}",
            "--max-restarts=1",
            "--no-python",
            *launcher_args(machines, tmp_root),
            *_JOB_MODULE,
            *job.to_args(),
        ]
        returncode, wall = run_job(
            name,
            cmd,
            env=env,
            cwd=root,
            log_path=log_path,
            run_dir=run_dir,
            nproc=options.nproc,
            timeout_s=options.timeout_s,
            stall_timeout_s=options.stall_timeout_s,
            progress=lambda phase, step: report(name, phase, step, job.steps),
        )
    finally:
        stop_preloaders(preloaders)
        stop_snapshot_keepers(buddy_pid, tmp_root, root)
        shutil.rmtree(tmp_root, ignore_errors=True)
    if returncode != 0:
        raise BenchError(f"{name}: the job exited with status {returncode} (log: {log_path})")
    report(name, "done", job.steps, job.steps)
    results = compute_runs([run_dir])
    if len(results) != 1:
        raise BenchError(f"{name}: expected the events of one job in {run_dir}, found {len(results)}")
    return ConfigResult(
        name=name,
        run_dir=run_dir,
        log_path=log_path,
        wall_s=wall,
        result=results[0],
        startup=_startup_reports(run_dir),
        cache=_cache_counters(machines),
        preload_start_s=preload_start_s,
    )


def _job_env(
    name: str,
    root: Path,
    tmp_root: Path,
    run_dir: Path,
    bench_id: str,
    server: CacheServer | None,
    compile_mode: str = "inline",
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_INHERITED_PREFIXES)}
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        {
            "HOME": str(home),
            "TMPDIR": str(tmp_root),
            "PYTHONUNBUFFERED": "1",
            "WARMSTART_RUN_DIR": str(run_dir),
            "WARMSTART_JOB_ID": f"{name}-{bench_id}",
            # 2 ranks on a small machine: one thread each, and one Inductor compile thread
            "OMP_NUM_THREADS": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            # torchrun keeps one rendezvous TCPStore across restarts; the restarted ranks could read the
            # dead ranks' gloo addresses from it (pytorch/pytorch#135712). One store per attempt instead.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
    )
    if server is not None:
        env.update(
            {
                "WARMSTART": "1",
                "WARMSTART_CACHE_URL": server.writer_url,
                "WARMSTART_KEY_FILE": server.signing_key_file,
                "WARMSTART_NAMESPACE": f"bench-{bench_id}",
                "WARMSTART_COMPILE": compile_mode,
            }
        )
        dynamo = dynamo_frames_given()  # the one setting the caller chooses: compiled frames on or off
        if dynamo is not None:
            env["WARMSTART_DYNAMO"] = dynamo
    return env


def _snapshot_figures(run_dir: Path) -> dict[str, Any] | None:
    """What the per-step snapshots cost and moved, over every rank of the attempt that finished (the
    ``snapshots-r<rank>-a<attempt>.json`` files); ``None`` without snapshots."""
    reports = []
    for path in sorted(run_dir.glob("snapshots-r*-a*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    taken = sum(r["taken"] for r in reports)
    if not taken:
        return None
    return {
        "taken": taken,
        "skipped": sum(r["skipped"] for r in reports),
        "rows_per_step": sum(r["rows_per_step"] * r["taken"] for r in reports) / taken,
        "bytes_per_step": sum(r["bytes_per_step"] * r["taken"] for r in reports) / taken,
        "capture_ms_per_step": 1000 * sum(r["capture_s"] for r in reports) / taken,
        "copy_wait_ms_per_step": 1000 * sum(r.get("wait_s", 0.0) for r in reports) / taken,
    }


def _startup_reports(run_dir: Path) -> list[dict[str, Any]]:
    reports = []
    for path in sorted(run_dir.glob("startup-r0-a*.json"), key=lambda p: int(p.stem.rsplit("-a", 1)[1])):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return reports


def _cache_counters(machines: Path) -> dict[str, dict[str, int]]:
    from warmstart.compile_cache import stats as stats_mod

    totals: dict[str, dict[str, int]] = {}
    for path in sorted(machines.glob("attempt-*/warmstart-cache/stats.json")):
        for (tier, kind), counts in stats_mod.load(path).items():
            row = totals.setdefault(f"{tier}/{kind}", {"hits": 0, "misses": 0, "writes": 0, "errors": 0})
            for field in row:
                row[field] += int(getattr(counts, field))
    return totals
