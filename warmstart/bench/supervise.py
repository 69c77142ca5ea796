"""Process supervision for the cold-vs-warm benchmark: the new machines, torchrun, the preloaders, the
cache server, timeouts and the no-progress watchdog.

Each attempt of a configuration lands on "a new machine": a two-line shell launcher (keyed on
``TORCHELASTIC_RESTART_COUNT``) makes fresh local directories before Python starts, with ``TMPDIR``
under a short root of its own (:func:`short_tmp_root`). :func:`run_job` runs one configuration's
torchrun in a session of its own and follows rank 0's events to report its phase; it stops the job
(torchrun, then every process left under it) when it runs too long, and when the run directory's
event files stop growing it has every rank dump its Python stacks into the log first. What runs, and
what the figures are, is ``cold_vs_warm``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from warmstart._net import free_port
from warmstart.compile_cache.doctor_checks import AF_UNIX_PATH_MAX, SOCKET_SUFFIX, effective_tmpdir
from warmstart.errors import WarmstartError
from warmstart.metrics.event_files import LineTail, recorder_files
from warmstart.metrics.events import (
    AttemptStart,
    Begin,
    CheckpointCommitted,
    End,
    Event,
    Failure,
    Step,
    TrainEnd,
    parse_event,
)

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

_TMP_ATTEMPT = "/attempt-99"  # room for the launcher's attempt folder under the short root (the bench uses 0 and 1)
_TMP_PREFIX = "ws-"  # tempfile.mkdtemp(prefix=...) appends 8 random characters
_TMP_BASES = ("/tmp", "/dev/shm")
"""Where the short temporary roots go when the caller's TMPDIR is too long for them."""


class BenchError(WarmstartError):
    """A configuration did not finish; the message names it, its exit status and its log."""


# -- new machines ------------------------------------------------------------------------------------


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


def start_preloaders(
    env: dict[str, str], machines: Path, tmp_root: Path, attempts: int
) -> tuple[list[str], list[float]]:
    """Bring up each attempt's machine with its preloader, serving the ranks' environment there."""
    from warmstart.preload import control

    sockets: list[str] = []
    seconds: list[float] = []
    for attempt in range(attempts):
        started = time.monotonic()
        try:
            info = control.start(environ={**env, **machine_env(machines, tmp_root, attempt)})
        except WarmstartError as exc:
            stop_preloaders(sockets)
            raise BenchError(f"warm: the preloader of machine {attempt} did not start: {exc}") from exc
        seconds.append(time.monotonic() - started)
        sockets.append(info["socket"])
    return sockets, seconds


def stop_preloaders(sockets: list[str]) -> None:
    from warmstart.preload import control

    for path in sockets:
        control.stop(path)


def start_snapshot_buddy(env: dict[str, str], log_path: Path) -> tuple[str, int]:
    """The buddy node's snapshot keeper for one configuration (in a fleet, the keeper of another
    node): on a free TCP port, signing with the key the configuration's environment gives. Returns its
    address and pid.

    Raises:
        BenchError: it did not start.
    """
    from warmstart.checkpoint.keeper import KeeperError, keeper_secret, start_keeper
    from warmstart.config import Settings

    address = f"127.0.0.1:{free_port()}"
    try:
        pid = start_keeper(address, environ=env, log_path=log_path, secret=keeper_secret(Settings.from_env(env)))
    except (KeeperError, WarmstartError) as exc:
        raise BenchError(f"the snapshot buddy did not start: {exc} (log: {log_path})") from None
    assert pid is not None  # the port was free: nothing answered there before
    return address, pid


def stop_snapshot_keepers(
    buddy_pid: int | None, tmp_root: Path, log_dir: Path, pattern: str = "attempt-*/warmstart-keeper.sock"
) -> None:
    """Stop the buddy and every machine's node keeper (their sockets: ``pattern`` under ``tmp_root``;
    each runs in a session of its own, so the job's teardown does not reach them), keeping the
    machines' keeper logs in ``log_dir``."""
    from warmstart.checkpoint.keeper import KeeperClient, KeeperError

    pids = [] if buddy_pid is None else [buddy_pid]
    for sock in sorted(tmp_root.glob(pattern)):
        with contextlib.suppress(KeeperError):
            pids.append(KeeperClient(f"unix:{sock}", timeout_s=1.0).request({"op": "ping"})[0]["pid"])
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for log in sorted(tmp_root.glob(pattern + ".log")):
        with contextlib.suppress(OSError):
            if log.stat().st_size:
                (log_dir / f"keeper-{log.parent.name}.log").write_bytes(log.read_bytes())


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


# -- running a job ------------------------------------------------------------------------------------


def run_job(
    name: str,
    cmd: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    log_path: Path,
    run_dir: Path,
    nproc: int,
    timeout_s: float,
    stall_timeout_s: float,
    progress: Callable[[str, int], None],
) -> tuple[int, float]:
    """Run torchrun's command line ``cmd`` until it exits; return its exit status and wall time.

    It runs in a session of its own, its output appended to ``log_path`` (``O_APPEND``: the watchdog's
    notes never overwrite the job's lines); ``progress(phase, step)`` hears what rank 0's events in
    ``run_dir`` say it is doing. Any error stops it and every process under it.

    Raises:
        BenchError: it ran past ``timeout_s``, or recorded no event for ``stall_timeout_s`` (its ranks
            then dumped their Python stacks into the log first).
    """
    started = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        tail = _EventTail(run_dir)
        watchdog = _Watchdog(run_dir, stall_timeout_s)
        try:
            while proc.poll() is None:
                if time.monotonic() - started > timeout_s:
                    _stop(proc)
                    raise BenchError(f"{name}: still running after {timeout_s:.0f} s; stopped it (log: {log_path})")
                if watchdog.stalled():
                    raise _stalled(name, proc, run_dir, log_path, stall_timeout_s, nproc)
                progress(*tail.poll())
                time.sleep(0.5)
        except BaseException:
            _stop(proc)
            raise
    return proc.returncode, time.monotonic() - started


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
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    _kill_all(left)


def _kill_all(pids: list[int]) -> None:
    # each rank leads a session of its own (torchrun's subprocess handler): kill its group (the rank,
    # its loader workers, its compile workers), then any stray process by pid
    for pid in pids:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


# -- the no-progress watchdog ------------------------------------------------------------------------


class _Watchdog:
    """Says when the run directory's event files have not grown for ``timeout_s``."""

    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        self.run_dir, self.timeout_s = run_dir, timeout_s
        self._size = -1
        self._since = time.monotonic()

    def stalled(self) -> bool:
        size = 0
        for path in recorder_files(self.run_dir):
            try:
                size += path.stat().st_size
            except OSError:
                continue
        now = time.monotonic()
        if size != self._size:
            self._size, self._since = size, now
        return now - self._since > self.timeout_s


def _stalled(
    name: str, proc: subprocess.Popen, run_dir: Path, log_path: Path, stall_timeout_s: float, nproc: int
) -> BenchError:
    """Dump every rank's Python stacks into the log, kill the configuration, say where it stood."""
    ranks = _ranks(proc.pid)
    for pid, label in _dumpable(proc.pid).items():
        _note(
            log_path,
            f"warmstart bench watchdog: no ETT event for {stall_timeout_s:.0f} s; "
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
    attempt, stages = _last_stages(run_dir, nproc, attempts[-1] if attempts else None)
    unwritten = _unwritten_events(log_path)
    return BenchError(
        f"{name}: attempt {attempt} recorded no ETT event for {stall_timeout_s:.0f} s "
        f"(last stage: {stages}){unwritten}; dumped every rank's Python stacks into the log and stopped it "
        f"(log: {log_path})"
    )


def _unwritten_events(log_path: Path) -> str:
    """What a rank said when it could not write its events (a full disk, say): then the job may have
    gone on and only its record stopped. Empty when no rank said so."""
    try:
        with open(log_path, errors="replace") as log:
            for line in log:
                if "cannot write ETT events" in line:
                    return f"; a rank could not write its events ({line.strip()[:200]})"
    except OSError:
        pass
    return ""


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
    last: dict[tuple[int, int], Event] = {}
    for path in recorder_files(run_dir):
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            event = _parsed(line)
            if event is not None:  # else a line being written
                last[(event.attempt, event.rank)] = event
                break
    if attempt is None:
        attempt = max((a for a, _ in last), default=0)
    parts = [f"rank {rank} {_describe(last.get((attempt, rank)))}" for rank in range(nproc)]
    return attempt, ", ".join(parts)


def _describe(event: Event | None) -> str:
    if event is None:
        return "no event yet"
    if isinstance(event, Begin):
        return f"in {event.span}"
    if isinstance(event, End):
        return f"after {event.span}"
    if isinstance(event, Step):
        return f"in step {event.step}"
    if isinstance(event, CheckpointCommitted):
        return f"after committing step {event.step}"
    if isinstance(event, Failure):
        return f"failed ({event.reason})"
    return f"after {event.event}"


def _parsed(line: bytes) -> Event | None:
    """The event of one line; ``None`` for a line that is none (a torn write, still under way)."""
    try:
        return parse_event(json.loads(line))
    except ValueError:
        return None


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


class _EventTail:
    """Follows rank 0's event files to say what a running job is doing."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._tails: dict[Path, LineTail] = {}
        self.phase, self.step = "starting", 0
        self._training = False

    def poll(self) -> tuple[str, int]:
        for path in recorder_files(self.run_dir, rank=0):
            tail = self._tails.setdefault(path, LineTail(path))
            data, _ = tail.read()  # the job only ever appends to its files
            for line in data.splitlines():
                event = _parsed(line)
                if event is not None:
                    self._see(event)
        return self.phase, self.step

    def _see(self, event: Event) -> None:
        attempt = event.attempt
        if isinstance(event, AttemptStart):
            self.phase, self._training = f"attempt {attempt}: starting up", False
        elif isinstance(event, Begin) and not self._training:  # start-up stages; in the loop, only steps
            self.phase = f"attempt {attempt}: {event.span}"
        elif isinstance(event, Step):
            self.phase, self.step, self._training = f"attempt {attempt}: training", event.step + 1, True
        elif isinstance(event, Failure):
            self.phase, self._training = f"attempt {attempt}: failed, restarting", False
        elif isinstance(event, TrainEnd):
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
            state = server.start(server.ServerOptions(dir=directory, port=free_port(), maxmemory=_SERVER_MAXMEMORY))
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

        with contextlib.suppress(WarmstartError, OSError):
            server.stop(self.directory)
