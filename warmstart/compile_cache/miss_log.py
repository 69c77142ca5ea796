"""The miss log: every lookup of a job that missed, with its reason, for ``warmstart cache explain``.

A :class:`MissLog` observes the process's store and appends one JSON line per miss to
``<run dir>/cache-misses/<host>-<pid>.ndjson`` (not ``*.jsonl``: the run directory's ETT readers
never see it), in every process of the job, compile workers included. The local cache directory
keeps the path of the last run directory it logged to (``last-run``), so ``explain`` without an
argument finds the last job, and the last few (``runs``), so ``explain`` can tell an entry missed for
the first time from one that every earlier job missed too (one torch never stores). Writing costs
one ``write`` per miss and never raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from warmstart._fileio import write_file
from warmstart.compile_cache.storage import Lookup, Miss

log = logging.getLogger("warmstart.cache")

MISSES_DIR = "cache-misses"
LAST_RUN_FILE = "last-run"
RUNS_FILE = "runs"
_RUNS_KEPT = 20  # run directories remembered in RUNS_FILE, newest last
_MAX_FIELD = 400  # a key or detail longer than this is cut: the log is for reading, not replaying


def job_run_dir() -> Path:
    """This job's run directory, as the ETT recorder chooses it: ``WARMSTART_RUN_DIR``, else
    ``warmstart-runs/<job id>``. A job without an id gets one now, exported so that its other
    processes (and its recorder) use the same."""
    from warmstart.config import ensure_job_id, job_identity, job_run_dir

    identity = job_identity()
    return job_run_dir(identity, ensure_job_id(identity)).absolute()


class MissLog:
    """A store observer that logs misses under ``run_dir`` (resolved at the first miss when ``None``).

    Args:
        run_dir: the job's run directory; ``None``: :func:`job_run_dir` at the first miss.
        cache_dir: the local cache directory, where the last run directory is remembered.
        namespace, key_id: what this process's store reads under, written with each miss.
    """

    def __init__(self, run_dir: Path | None, cache_dir: Path | None, *, namespace: str = "", key_id: str = "") -> None:
        self.run_dir = run_dir
        self.cache_dir = cache_dir
        self.namespace = namespace
        self.key_id = key_id
        self._fd: int | None = None
        self._pid = 0
        self._broken = False

    @contextlib.contextmanager
    def waiting(self, kind: str) -> Iterator[None]:
        yield

    def looked_up(self, kind: str, key: str, result: Lookup) -> None:
        if not isinstance(result, Miss) or self._broken:
            return
        line = {
            "ts": round(time.time(), 3),
            "kind": kind,
            "key": key[:_MAX_FIELD],
            "reason": result.reason.value,
            "tier": result.tier,
            "namespace": self.namespace,
            "key_id": self.key_id,
        }
        if result.detail:
            line["detail"] = result.detail[:_MAX_FIELD]
        try:
            os.write(self._file(), (json.dumps(line) + "\n").encode())
        except Exception as exc:  # an unwritable run directory costs the log, never the lookup
            self._broken = True
            log.debug("warmstart: cannot write the cache miss log: %s", exc)

    def _file(self) -> int:
        if self._fd is not None and self._pid == os.getpid():
            return self._fd
        if self.run_dir is None:
            self.run_dir = job_run_dir()
        directory = self.run_dir / MISSES_DIR
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{socket.gethostname()}-{os.getpid()}.ndjson"
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._pid = os.getpid()
        if self.cache_dir is not None:
            _remember(self.cache_dir, self.run_dir)
        return self._fd


def _remember(cache_dir: Path, run_dir: Path) -> None:
    pointer = cache_dir / LAST_RUN_FILE
    try:
        write_file(pointer, str(run_dir) + "\n", 0o644)
        runs = [r for r in recent_run_dirs(cache_dir) if r != run_dir][-(_RUNS_KEPT - 1) :]
        write_file(cache_dir / RUNS_FILE, "".join(f"{r}\n" for r in (*runs, run_dir)), 0o644)
    except OSError:
        log.debug("warmstart: cannot remember the last run directory in %s", cache_dir)


def recent_run_dirs(cache_dir: Path) -> list[Path]:
    """The last run directories that jobs using ``cache_dir`` logged misses to, oldest first."""
    try:
        return [Path(line) for line in (cache_dir / RUNS_FILE).read_text().splitlines() if line.strip()]
    except OSError:
        return []


def last_run_dir(cache_dir: Path) -> Path | None:
    """The run directory the last job using ``cache_dir`` logged misses to, if any."""
    try:
        return Path((cache_dir / LAST_RUN_FILE).read_text().strip()) or None
    except OSError:
        return None


def read_misses(run_dir: Path) -> list[dict[str, object]]:
    """Every miss logged under ``run_dir`` (any depth), oldest first; torn lines are skipped."""
    misses = []
    for path in sorted(Path(run_dir).rglob(f"{MISSES_DIR}/*.ndjson")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for raw in text.splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # a line cut short by a killed process
            if isinstance(line, dict) and {"kind", "key", "reason"} <= line.keys():
                misses.append(line)
    misses.sort(key=lambda m: m.get("ts", 0))
    return misses
