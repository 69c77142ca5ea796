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
metrics calculator over each configuration's run directory. This module owns the orchestration
(server, launches, progress, results); the job is ``reference_job``. The table is built here; the
page is the figures table followed by the metrics package's report of the three runs.

A watchdog stops a configuration that records no new ETT event for ``stall_timeout_s``: it first
has every rank dump its Python stacks into the log (the job registers ``faulthandler`` on
``SIGUSR1``), then kills the configuration and raises one line naming the configuration, the
attempt, each rank's last stage and the log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmstart.bench.config import JobConfig
from warmstart.compile_cache.doctor_checks import AF_UNIX_PATH_MAX, SOCKET_SUFFIX, effective_tmpdir
from warmstart.errors import WarmstartError

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

# The "new machine" of every attempt: fresh local directories, made before Python (and with it
# warmstart's start-up hook, Inductor and Triton) reads any of them. $1: the configuration's machines
# (under the work dir), $2: its short temporary root (TMPDIR: AF_UNIX socket paths are made under it);
# the rest is Python's command line.
_LAUNCHER = """\
a="attempt-${TORCHELASTIC_RESTART_COUNT:-0}"; m="$1/$a"; t="$2/$a"; shift 2
mkdir -p "$m/home" "$t" "$m/inductor" "$m/triton" "$m/warmstart-cache"
export HOME="$m/home" XDG_CACHE_HOME="$m/home/.cache" TMPDIR="$t" TORCHINDUCTOR_CACHE_DIR="$m/inductor" \
TRITON_CACHE_DIR="$m/triton" WARMSTART_CACHE_DIR="$m/warmstart-cache"
exec @PYTHON@ "$@"
"""
_JOB_MODULE = ("-m", "warmstart.bench.reference_job")
_TMP_ATTEMPT = "/attempt-99"  # room for the launcher's attempt folder under the short root (the bench uses 0 and 1)
_TMP_PREFIX = "ws-"  # tempfile.mkdtemp(prefix=...) appends 8 random characters
_TMP_BASES = ("/tmp", "/dev/shm")
"""Where the short temporary roots go when the caller's TMPDIR is too long for them."""

# Variables a configuration must not inherit from the caller's shell: each run sets its own.
_INHERITED_PREFIXES = ("WARMSTART", "TORCHINDUCTOR_", "TRITON_", "TORCHELASTIC_")


class BenchError(WarmstartError):
    """A configuration did not finish; the message names it, its exit status and its log."""


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
                }
                for a in r.attempts
            ],
            "resumed_from_step": [rep.get("resumed_from_step") for rep in self.startup],
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
    try:
        env = _job_env(name, root, tmp_root, run_dir, bench_id, server)
        if name == "warm" and options.preload:
            # What a user names for their own job: its trainer module, preloaded with torch and TorchRec.
            env["WARMSTART_PRELOAD_MODULES"] = "warmstart.bench.trainer"
            report(name, "bringing the machines up (their preloaders)", 0, job.steps)
            preloaders, preload_start_s = _start_preloaders(env, machines, tmp_root, attempts=2)
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
        started = time.monotonic()
        with open(log_path, "ab") as log:  # O_APPEND: the watchdog's notes never overwrite the job's lines
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True
            )
            tail = _EventTail(run_dir)
            watchdog = _Watchdog(run_dir, options.stall_timeout_s)
            try:
                while proc.poll() is None:
                    if time.monotonic() - started > options.timeout_s:
                        _stop(proc)
                        raise BenchError(
                            f"{name}: still running after {options.timeout_s:.0f} s; stopped it (log: {log_path})"
                        )
                    if watchdog.stalled():
                        raise _stalled(name, proc, run_dir, log_path, options)
                    phase, step = tail.poll()
                    report(name, phase, step, job.steps)
                    time.sleep(0.5)
            except BaseException:
                _stop(proc)
                raise
        wall = time.monotonic() - started
    finally:
        _stop_preloaders(preloaders)
        shutil.rmtree(tmp_root, ignore_errors=True)
    if proc.returncode != 0:
        raise BenchError(f"{name}: the job exited with status {proc.returncode} (log: {log_path})")
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


def machine_env(machines: Path, tmp_root: Path, attempt: int) -> dict[str, str]:
    """The variables the launcher sets for ``attempt``'s new machine (and makes its directories)."""
    m, t = machines / f"attempt-{attempt}", tmp_root / f"attempt-{attempt}"
    dirs = {
        "HOME": m / "home",
        "TMPDIR": t,
        "TORCHINDUCTOR_CACHE_DIR": m / "inductor",
        "TRITON_CACHE_DIR": m / "triton",
        "WARMSTART_CACHE_DIR": m / "warmstart-cache",
    }
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    return {**{k: str(v) for k, v in dirs.items()}, "XDG_CACHE_HOME": str(m / "home" / ".cache")}


def _start_preloaders(
    env: dict[str, str], machines: Path, tmp_root: Path, attempts: int
) -> tuple[list[str], list[float]]:
    """Bring up each attempt's machine with its preloader, serving the ranks' environment there."""
    from warmstart.preload import control

    sockets, seconds = [], []
    for attempt in range(attempts):
        started = time.monotonic()
        try:
            info = control.start(environ={**env, **machine_env(machines, tmp_root, attempt)})
        except WarmstartError as exc:
            _stop_preloaders(sockets)
            raise BenchError(f"warm: the preloader of machine {attempt} did not start: {exc}") from exc
        seconds.append(time.monotonic() - started)
        sockets.append(info["socket"])
    return sockets, seconds


def _stop_preloaders(sockets: list[str]) -> None:
    from warmstart.preload import control

    for path in sockets:
        control.stop(path)


def launcher_args(machines: Path, tmp_root: Path) -> list[str]:
    """The command line that runs Python (its arguments follow) on a new machine under ``machines``,
    with ``TMPDIR`` under ``tmp_root``: the launcher torchrun starts for every rank of every attempt."""
    launcher = _LAUNCHER.replace("@PYTHON@", shlex.quote(sys.executable))
    return ["/bin/sh", "-c", launcher, "sh", str(machines), str(tmp_root)]


def short_tmp_root() -> Path:
    """A fresh, empty directory for one configuration's machines' ``TMPDIR`` (the caller removes it).

    DataLoader workers hand batches over ``AF_UNIX`` sockets that multiprocessing makes under
    ``TMPDIR`` (``pymp-XXXXXXXX/listener-XXXXXXXX``), and Linux refuses paths over 107 bytes: the
    batch is then lost and the job hangs. The root goes under the caller's ``TMPDIR`` when the
    longest socket path of the deepest attempt fits there, else under ``/tmp``, else ``/dev/shm``.

    Raises:
        BenchError: none of them is a writable directory short enough.
    """
    suffix = len(f"/{_TMP_PREFIX}XXXXXXXX{_TMP_ATTEMPT}{SOCKET_SUFFIX}")
    tried = []
    for base in (effective_tmpdir(), *_TMP_BASES):
        if base in tried:
            continue
        tried.append(base)
        if (
            len(os.fsencode(base)) + suffix <= AF_UNIX_PATH_MAX
            and os.path.isdir(base)
            and os.access(base, os.W_OK | os.X_OK)
        ):
            return Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=base))
    raise BenchError(
        f"no writable temporary directory short enough for DataLoader sockets "
        f"(at most {AF_UNIX_PATH_MAX - suffix} bytes): tried {', '.join(tried)}"
    )


def _job_env(
    name: str, root: Path, tmp_root: Path, run_dir: Path, bench_id: str, server: CacheServer | None
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
            }
        )
        if "WARMSTART_DYNAMO" in os.environ:  # the one setting the caller chooses: compiled frames on or off
            env["WARMSTART_DYNAMO"] = os.environ["WARMSTART_DYNAMO"]
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Stop torchrun (its own session) and every process it started: torchrun stops its ranks on
    SIGTERM; whatever is left once it is gone (each rank runs in a session of its own) is killed."""
    if proc.poll() is not None:
        return
    left = _descendants(proc.pid)
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _kill_all(left)


def _kill(proc: subprocess.Popen) -> None:
    """Kill torchrun first (so that it restarts nothing), then every process under it."""
    left = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    _kill_all(left)


def _kill_all(pids: list[int]) -> None:
    # each rank leads a session of its own (torchrun's subprocess handler): kill its group (the rank,
    # its loader workers, its compile workers), then any stray process by pid
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# -- the no-progress watchdog ------------------------------------------------------------------------


class _Watchdog:
    """Says when the run directory's event files have not grown for ``timeout_s``."""

    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        self.run_dir, self.timeout_s = run_dir, timeout_s
        self._size = -1
        self._since = time.monotonic()

    def stalled(self) -> bool:
        size = 0
        for path in self.run_dir.glob("*.jsonl"):
            try:
                size += path.stat().st_size
            except OSError:
                continue
        now = time.monotonic()
        if size != self._size:
            self._size, self._since = size, now
        return now - self._since > self.timeout_s


def _stalled(name: str, proc: subprocess.Popen, run_dir: Path, log_path: Path, options: BenchOptions) -> BenchError:
    """Dump every rank's Python stacks into the log, kill the configuration, say where it stood."""
    ranks = _ranks(proc.pid)
    for pid, label in _dumpable(proc.pid).items():
        _note(
            log_path,
            f"warmstart bench watchdog: no ETT event for {options.stall_timeout_s:.0f} s; "
            f"Python stacks of {label} (pid {pid}):",
        )
        try:
            os.kill(pid, signal.SIGUSR1)  # faulthandler, registered by the reference job
            os.kill(pid, signal.SIGCONT)  # a stopped process dumps once it runs again
        except ProcessLookupError:
            continue
        _wait_quiet(log_path, quiet_s=0.3, limit_s=3.0)  # one process at a time: the dumps do not interleave
    _kill(proc)
    _note(log_path, "warmstart bench watchdog: stopped the configuration")
    attempts = sorted({a for a in ranks.values() if a is not None})
    attempt, stages = _last_stages(run_dir, options.nproc, attempts[-1] if attempts else None)
    return BenchError(
        f"{name}: attempt {attempt} recorded no ETT event for {options.stall_timeout_s:.0f} s "
        f"(last stage: {stages}); dumped every rank's Python stacks into the log and stopped it "
        f"(log: {log_path})"
    )


def _note(log_path: Path, line: str) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n--- {line}\n")


def _wait_quiet(path: Path, *, quiet_s: float, limit_s: float) -> None:
    """Wait until ``path`` has not grown for ``quiet_s`` (at most ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    size, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now_size = path.stat().st_size if path.exists() else 0
        if now_size != size:
            size, since = now_size, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def _last_stages(run_dir: Path, nproc: int, attempt: int | None) -> tuple[int, str]:
    """The attempt (the live ranks' one, else the latest with events) and each of its ranks' last event."""
    last: dict[tuple[int, int], dict[str, Any]] = {}
    for path in run_dir.glob("events-r*-a*.jsonl"):
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line being written
            last[(int(event.get("attempt", 0)), int(event.get("rank", 0)))] = event
            break
    if attempt is None:
        attempt = max((a for a, _ in last), default=0)
    parts = [f"rank {rank} {_describe(last.get((attempt, rank)))}" for rank in range(nproc)]
    return attempt, ", ".join(parts)


def _describe(event: dict[str, Any] | None) -> str:
    if event is None:
        return "no event yet"
    kind = event.get("event")
    if kind == "begin":
        return f"in {event.get('span')}"
    if kind == "end":
        return f"after {event.get('span')}"
    if kind == "step":
        return f"in step {event.get('step')}"
    if kind == "checkpoint_committed":
        return f"after committing step {event.get('step')}"
    if kind == "failure":
        return f"failed ({event.get('reason')})"
    return f"after {kind}"


def _children() -> dict[int, list[int]]:
    """Parent pid to child pids, from ``/proc``."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])  # after "(comm)": state, ppid
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rank_envs(torchrun_pid: int) -> dict[int, dict[bytes, bytes]]:
    """torchrun's children that are ranks (``sh`` exec'd the job; torchrun set ``RANK``): pid to environment."""
    ranks = {}
    for pid in _children().get(torchrun_pid, []):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env:
            ranks[pid] = env
    return ranks


def _ranks(torchrun_pid: int) -> dict[int, int | None]:
    """The ranks' pids to their attempt number (``TORCHELASTIC_RESTART_COUNT``)."""
    out = {}
    for pid, env in _rank_envs(torchrun_pid).items():
        count = env.get(b"TORCHELASTIC_RESTART_COUNT", b"")
        out[pid] = int(count) if count.isdigit() else None
    return out


def _dumpable(torchrun_pid: int) -> dict[int, str]:
    """The ranks, then their descendants, that catch SIGUSR1 (faulthandler's; forked loader workers
    inherit it), to a label. A process that does not catch it would die of it, so it is left alone."""
    targets: dict[int, str] = {}
    ranks = {pid: env.get(b"RANK", b"?").decode() for pid, env in _rank_envs(torchrun_pid).items()}
    candidates = [(pid, f"rank {rank}") for pid, rank in ranks.items()]
    candidates += [
        (child, f"a child process of rank {rank}") for pid, rank in ranks.items() for child in _descendants(pid)
    ]
    for pid, label in candidates:
        try:
            with open(f"/proc/{pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        except (OSError, StopIteration, ValueError):
            continue
        if caught & (1 << (signal.SIGUSR1 - 1)):
            targets.setdefault(pid, label)
    return targets


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


class _EventTail:
    """Follows rank 0's event files to say what a running job is doing."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._offsets: dict[Path, int] = {}
        self.phase, self.step = "starting", 0
        self._training = False

    def poll(self) -> tuple[str, int]:
        for path in sorted(self.run_dir.glob("events-r0-a*.jsonl")):
            attempt = path.stem.rsplit("-a", 1)[1]
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                self._see(event, attempt)
        return self.phase, self.step

    def _see(self, event: dict[str, Any], attempt: str) -> None:
        kind = event.get("event")
        if kind == "attempt_start":
            self.phase, self._training = f"attempt {attempt}: starting up", False
        elif kind == "begin" and not self._training:  # start-up stages; in the loop, only steps
            self.phase = f"attempt {attempt}: {event.get('span')}"
        elif kind == "step":
            self.phase, self.step, self._training = f"attempt {attempt}: training", int(event["step"]) + 1, True
        elif kind == "failure":
            self.phase, self._training = f"attempt {attempt}: failed, restarting", False
        elif kind == "train_end":
            self.phase = f"attempt {attempt}: shutting down"


# -- the throwaway cache server ------------------------------------------------------------------------

_SERVER_MAXMEMORY = 1024**3  # room for every artifact of the reference job, cold's and warm's


@dataclasses.dataclass(frozen=True)
class CacheServer:
    """A cache server (one local node on a free port) started for the benchmark and stopped after it."""

    directory: Path
    writer_url: str
    signing_key_file: str

    @classmethod
    def start(cls, directory: Path) -> CacheServer:
        """Start a server whose configuration, credentials and data live in ``directory``.

        Raises:
            BenchError: the server did not start (its message is passed on).
        """
        from warmstart import server

        try:
            state = server.start(server.ServerOptions(dir=directory, port=_free_port(), maxmemory=_SERVER_MAXMEMORY))
            credentials = server.Credentials.load(directory)
        except (WarmstartError, OSError, subprocess.SubprocessError) as exc:
            raise BenchError(f"could not start the cache server: {exc}") from None
        return cls(
            directory=directory,
            writer_url=state.url("writer", credentials),
            signing_key_file=str(credentials.signing_key_file),
        )

    def stop(self) -> None:
        """Stop the server and wait for its processes; a failure is ignored (the server is a throwaway)."""
        from warmstart import server

        try:
            server.stop(self.directory)
        except (WarmstartError, OSError):
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the table and the page ----------------------------------------------------------------------------

_TITLE = "warmstart bench cold-vs-warm"
_LABELS = {
    "time_to_start_s": "time to start (s)",
    "time_to_recover_s": "time to recover (s)",
    "compile_s": "compile (s)",
    "sharding_plan_s": "sharding plan (s)",
    "checkpoint_blocking_s": "checkpoint blocking (s)",
    "e2e_s": "end to end (s)",
    "ett_pct": "ETT %",
}
_HEADERS = ("figure", *CONFIGS, "warm / baseline")


def table_rows(results: dict[str, ConfigResult]) -> list[list[Any]]:
    """One row per figure: label, baseline, cold, warm, warm/baseline (``x`` ratio)."""
    figures = {name: res.figures() for name, res in results.items()}
    ratio = ratios(results)
    rows = []
    for key in FIGURES:
        r = ratio[key]
        rows.append([_LABELS[key], *(figures[name][key] for name in CONFIGS), "-" if r is None else f"{r:.2f}x"])
    return rows


def render_page(results: dict[str, ConfigResult]) -> str:
    """A self-contained HTML page: the figures of the three configurations side by side, then the
    metrics package's report of their runs (timelines and breakdowns)."""
    from warmstart.metrics.report import render_html

    return render_html(
        [results[name].result for name in CONFIGS], title=_TITLE, intro=[list(_HEADERS), *table_rows(results)]
    )
