"""The recorder: what a training process calls to write its ETT events (docs/reference.md#events).

It owns the in-process side only: cheap calls that append a tuple to a buffer, a background thread
that turns the buffer into event structs, encodes them (``events.encode_events``: the same schema
the reader checks) and appends them to this rank's and attempt's file every
``FLUSH_INTERVAL_S``, and the last words of a dying process (flush at exit; an uncaught exception or
SIGTERM writes a ``failure`` first, then the previous hook or the default action runs). It never
blocks training on I/O and never raises into it over a write error. It computes nothing: that is
``calculator.py``. :func:`get_recorder` is the process-wide instance built from the job identity
(``warmstart.config.job_identity``); a :class:`NullRecorder` (every call a no-op) when metrics are off.
Building it starts the live-metrics exporter (``live.py``) when ``WARMSTART_METRICS_*`` asks for one.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from warmstart import _defaults, _launch
from warmstart.config import ensure_job_id, job_identity, job_run_dir, metrics_on, new_job_id
from warmstart.metrics.buckets import PRELOAD_HANDOVER, PROCESS_LAUNCH
from warmstart.metrics.event_files import file_name
from warmstart.metrics.events import (
    FAILURE_CATEGORIES,
    RESUME_SOURCES,
    AttemptEnd,
    AttemptStart,
    Begin,
    CheckpointCommitted,
    End,
    EventWriter,
    Failure,
    Resume,
    Step,
    TrainEnd,
    encode_events,
)

log = logging.getLogger(__name__)

# Buffered records are (kind, ts, *fields) tuples: the index of the event's struct type in _KINDS,
# then the fields its constructor takes after the job, attempt and rank. The flusher builds the
# structs. An int, not the type itself: a tuple of atomic values is untracked by the cyclic GC, so a
# million buffered events cost full collections nothing (with a type in them, they slow down 3x).
_KINDS = (AttemptStart, Begin, End, Step, CheckpointCommitted, Failure, TrainEnd, AttemptEnd, Resume)
_ATTEMPT_START, _BEGIN, _END, _STEP, _CKPT, _FAILURE, _TRAIN_END, _ATTEMPT_END, _RESUME = range(len(_KINDS))
_ENCODE_CHUNK = 1024  # events encoded per call: about half a millisecond
_INFRA_ERRORS = frozenset(
    {
        "ConnectionError",
        "TimeoutError",
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "BrokenPipeError",
    }
)

_live: weakref.WeakSet[Recorder] = weakref.WeakSet()
_hooks_installed = False
_hooks_lock = threading.Lock()


class _Span:
    """Context manager returned by :meth:`Recorder.span`."""

    __slots__ = ("_rec", "_name", "_bucket")

    def __init__(self, rec: Recorder | NullRecorder, name: str, bucket: str | None) -> None:
        self._rec, self._name, self._bucket = rec, name, bucket

    def __enter__(self) -> _Span:
        self._rec.begin(self._name, self._bucket)
        return self

    def __exit__(self, *exc: object) -> None:
        self._rec.end(self._name, self._bucket)


class Recorder:
    """Writes one rank's and one attempt's events to ``run_dir/events-r{rank}-a{attempt}.jsonl``.

    Example:
        >>> rec = Recorder("runs/job-1", job="job-1", rank=0, attempt=0)
        >>> rec.attempt_start(devices=8)
        >>> with rec.span("compile"):
        ...     pass
        >>> rec.step(0, samples=512)
        >>> rec.checkpoint_committed(0)
        >>> rec.train_end(); rec.attempt_end(); rec.close()

    Args:
        run_dir: directory of the run's event files (created on the first flush).
        job: job id; default the job identity's (``warmstart.config.job_identity``), else a generated one.
        rank: global rank; default the job identity's. Use -1 for job-level writers (schedulers).
        attempt: attempt number; default the job identity's.
        flush_interval_s: how often the background thread writes the buffer; 0 disables the thread
            (then only :meth:`flush`, :meth:`close`, exit and signals write).

    Raises:
        ConfigError: the identity is needed (an argument is left out) and the environment's rank or
            attempt is malformed.
    """

    enabled = True

    def __init__(
        self,
        run_dir: str | os.PathLike,
        job: str | None = None,
        rank: int | None = None,
        attempt: int | None = None,
        *,
        flush_interval_s: float = _defaults.FLUSH_INTERVAL_S,
    ) -> None:
        if not job or rank is None or attempt is None:  # only then: explicit arguments need no environment
            identity = job_identity()
            job = job or identity.job_id or new_job_id()
            rank = identity.rank if rank is None else rank
            attempt = identity.attempt if attempt is None else attempt
        self.run_dir = Path(run_dir)
        self.job, self.rank, self.attempt = job, int(rank), int(attempt)
        self.path = self.run_dir / file_name(self.rank, self.attempt)
        self.flush_interval_s = flush_interval_s
        self._buf: deque[tuple] = deque()  # append/popleft are atomic: no lock on the hot path
        self._append = self._buf.append
        self._time = time.time
        self._writer = EventWriter(self.path)
        self._flush_lock = threading.RLock()  # re-entrant: a SIGTERM may land mid-flush on this thread
        self._attempt_open = False
        self._recorded = False
        self._write_failed = False
        self._dropped_invalid = False
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inherited = False  # set in a forked child: the attempt's fate is the parent's to record
        self._launch: tuple[tuple, ...] = ()  # the process_launch span, held back until events of our own
        self._launch_noted = False
        _live.add(self)
        _install_process_hooks()
        self._start_thread()

    # -- events ------------------------------------------------------------------------------------

    def attempt_start(self, devices: int | None = None) -> None:
        """Hardware is allocated to this attempt: its clock starts. ``devices``: accelerators it holds."""
        self._attempt_open = True
        self._append((_ATTEMPT_START, self._time(), devices))

    def attempt_end(self) -> None:
        """The attempt released its hardware (written automatically at exit if still open)."""
        self._attempt_open = False
        self._append((_ATTEMPT_END, self._time()))

    def begin(self, name: str, bucket: str | None = None) -> None:
        """Start the span ``name``; ``bucket`` maps a custom span to a known bucket."""
        self._append((_BEGIN, self._time(), name, bucket))

    def end(self, name: str, bucket: str | None = None) -> None:
        """End the most recent open span ``name``."""
        self._append((_END, self._time(), name, bucket))

    def span(self, name: str, bucket: str | None = None) -> _Span:
        """Context manager recording ``begin``/``end`` of ``name`` around its body."""
        return _Span(self, name, bucket)

    def step(self, n: int, samples: int | None = None) -> None:
        """Step ``n`` starts consuming a batch (of ``samples`` samples). Costs well under 5 us."""
        self._append((_STEP, self._time(), n, samples))

    def checkpoint_committed(self, step: int) -> None:
        """The checkpoint holding every step ``<= step`` is durable."""
        self._append((_CKPT, self._time(), step))

    def resumed(self, step: int, source: str) -> None:
        """This attempt goes on after ``step``, restored from ``source`` (``checkpoint``, ``keeper``
        or ``buddy``); record it before the first step.

        Raises:
            ValueError: ``source`` is not one of those three.
        """
        if source not in RESUME_SOURCES:
            raise ValueError(f"resume source {source!r} is not valid: expected one of {', '.join(RESUME_SOURCES)}")
        self._append((_RESUME, self._time(), step, source))

    def failure(self, reason: str, category: str) -> None:
        """The attempt dies here; ``category`` is ``infra``, ``preemption`` or ``user``.

        Raises:
            ValueError: ``category`` is not one of those three.
        """
        if category not in FAILURE_CATEGORIES:
            raise ValueError(
                f"failure category {category!r} is not valid: expected one of {', '.join(FAILURE_CATEGORIES)}"
            )
        self._append((_FAILURE, self._time(), category, str(reason)))

    def train_end(self) -> None:
        """The training loop finished: shutdown starts."""
        self._append((_TRAIN_END, self._time()))

    def process_launch(self) -> bool:
        """Record this process's launch as a ``process_launch`` span: from the moment the OS started it
        to the moment its interpreter was ready (warmstart's start-up hook ran, with ``WARMSTART=1``).

        :func:`get_recorder` calls it for the process-wide recorder. The span is held back until this
        recorder writes events of its own, so a process that records nothing still writes nothing.

        In a process a preloader forked, the span is ``preload_handover`` (bucket ``process_launch``):
        from when the OS started the process that handed itself over to when the child was ready.

        Returns:
            False, recording nothing, when an end is unknown (no ``/proc``; no start-up hook ran in
            this interpreter), when this process is a fork that started after the hook ran, or when
            the launch is already recorded.
        """
        start, ready = _launch.process_start_ts(), _launch.interpreter_ready_ts
        if self._launch_noted or start is None or ready is None or not start < ready:
            return False
        self._launch_noted = True
        if _launch.forked_start_ts is not None:
            # Forked by a preloader: a span of its own name (the report names such attempts forked),
            # counted in the same bucket.
            name, bucket = PRELOAD_HANDOVER, PROCESS_LAUNCH
        else:
            name, bucket = PROCESS_LAUNCH, None
        self._launch = ((_BEGIN, start, name, bucket), (_END, ready, name, bucket))
        return True

    # -- writing -----------------------------------------------------------------------------------

    def flush(self) -> None:
        """Serialize the buffer and append it to the event file. Never raises on I/O errors."""
        with self._flush_lock:
            buf = self._buf
            n = len(buf)
            if not n:
                return
            self._recorded = True
            popleft, records = buf.popleft, []
            try:
                for _ in range(n):
                    records.append(popleft())
            except IndexError:  # a signal handler's flush on this thread took the rest
                pass
            if self._launch:  # first in the file: it happened before anything else this process records
                records[:0], self._launch = self._launch, ()
            data = self._encode(records)
            try:
                self._writer.write(data)
            except OSError as exc:
                if not self._write_failed:  # log once: a full disk must not flood the job's log
                    self._write_failed = True
                    log.warning("warmstart: cannot write ETT events to %s (%s); dropping them", self.path, exc)

    def close(self) -> None:
        """Flush, stop the background thread and close the file. Safe to call twice."""
        self._stop.set()
        self.flush()
        with self._flush_lock:
            self._writer.close()
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------

    def _encode(self, records: list[tuple]) -> bytes:
        job, attempt, rank, kinds = self.job, self.attempt, self.rank, _KINDS
        parts = []
        # Chunks: msgspec holds the GIL for a whole call, and a million-event call would stall the
        # training thread for a second; between chunks the interpreter can switch threads.
        for start in range(0, len(records), _ENCODE_CHUNK):
            chunk = records[start : start + _ENCODE_CHUNK]
            parts.append(
                self._encode_chunk([kinds[kind](ts, job, attempt, rank, *fields) for kind, ts, *fields in chunk])
            )
        return b"".join(parts)

    def _encode_chunk(self, events: list[Any]) -> bytes:
        try:
            return encode_events(events)
        except (TypeError, ValueError):
            pass
        # A caller passed a value the format refuses (a step that is not an integer, an empty span
        # name): drop that event alone, so that the file stays readable and training goes on.
        kept = []
        for event in events:
            try:
                kept.append(encode_events((event,)))
            except (TypeError, ValueError) as exc:
                if not self._dropped_invalid:  # log once: a bad call in a loop must not flood the log
                    self._dropped_invalid = True
                    log.warning("warmstart: dropping an invalid ETT event for %s (%s)", self.path, exc)
        return b"".join(kept)

    def _start_thread(self) -> None:
        if self.flush_interval_s <= 0:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="warmstart-ett-flush", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.flush()

    def _last_words(self, reason: str, category: str) -> None:
        """Record a failure (and the end of an open attempt) and flush: the process is dying."""
        if self._inherited or not (self._recorded or self._buf):
            return  # a process that recorded nothing (a compile worker, a forked helper) speaks for no attempt
        self._append((_FAILURE, self._time(), category, reason))
        if self._attempt_open:
            self.attempt_end()
        self.flush()

    def _at_exit(self) -> None:
        if self._attempt_open and not self._inherited and (self._recorded or self._buf):
            self.attempt_end()
        self.close()

    def _after_fork_in_child(self) -> None:
        # The child starts empty: what the parent buffered is the parent's to write. Its own events (if
        # any) are appended to the same file at flush or exit; there is no flusher thread after fork.
        self._inherited = True
        self._buf.clear()
        self._launch = ()  # the parent's launch, not ours to write
        self._flush_lock = threading.RLock()  # re-entrant: a SIGTERM may land mid-flush on this thread
        self._writer = EventWriter(self.path)
        self._thread = None
        self._stop = threading.Event()


class NullRecorder:
    """The recorder when metrics are off: every call is a no-op."""

    enabled = False
    job, rank, attempt, run_dir, path = "", 0, 0, None, None

    def attempt_start(self, devices: int | None = None) -> None:
        """No-op."""

    def attempt_end(self) -> None:
        """No-op."""

    def begin(self, name: str, bucket: str | None = None) -> None:
        """No-op."""

    def end(self, name: str, bucket: str | None = None) -> None:
        """No-op."""

    def span(self, name: str, bucket: str | None = None) -> _Span:
        """A context manager that records nothing."""
        return _Span(self, name, bucket)

    def step(self, n: int, samples: int | None = None) -> None:
        """No-op."""

    def checkpoint_committed(self, step: int) -> None:
        """No-op."""

    def resumed(self, step: int, source: str) -> None:
        """No-op."""

    def failure(self, reason: str, category: str) -> None:
        """No-op."""

    def train_end(self) -> None:
        """No-op."""

    def process_launch(self) -> bool:
        """Records nothing: returns False."""
        return False

    def flush(self) -> None:
        """No-op."""

    def close(self) -> None:
        """No-op."""


_process_recorder: Recorder | NullRecorder | None = None
_process_lock = threading.Lock()

ProcessRecorderHook = Callable[["Recorder"], "Callable[[bool], None] | None"]
"""Called with the process-wide recorder when it is built; returns what to call when it goes, if anything."""
_hooks: list[ProcessRecorderHook] = []
_undo_hooks: list[Callable[[bool], None]] = []  # what the hooks returned for the current recorder


def on_process_recorder(hook: ProcessRecorderHook) -> None:
    """Have ``hook(recorder)`` run whenever the process-wide recorder is built (metrics on).

    What it returns, if anything, is called when that recorder goes: with ``False`` at
    :func:`reset_process_recorder`, with ``True`` at exit, after the recorder's last events are
    written. A hook that raises is ignored: the metrics never fail the job.
    """
    _hooks.append(hook)


def _run_hooks(rec: Recorder) -> None:
    for hook in list(_hooks):
        try:
            undo = hook(rec)
        except Exception:
            continue
        if undo is not None:
            _undo_hooks.append(undo)


def _undo_process_hooks(at_exit: bool = False) -> None:
    while _undo_hooks:
        undo = _undo_hooks.pop()
        with contextlib.suppress(Exception):  # at exit too: the metrics never fail the job
            undo(at_exit)


def get_recorder() -> Recorder | NullRecorder:
    """The process-wide recorder, built once from the job identity (``warmstart.config.job_identity``).

    Its run directory defaults to ``./warmstart-runs/<job id>``. When the identity has no job id, one
    is generated and exported as ``WARMSTART_JOB_ID`` so that child processes share it. It records
    the process's launch (:meth:`Recorder.process_launch`) with its first events. Returns a
    :class:`NullRecorder` when metrics are off (neither a run directory nor ``WARMSTART=1``).

    Raises:
        ConfigError: metrics are on and the rank or attempt in the environment is malformed.
    """
    global _process_recorder
    rec = _process_recorder
    if rec is not None:
        return rec
    with _process_lock:
        if _process_recorder is None:
            # A malformed variable is an error only when metrics are on: library code asks for the
            # recorder in jobs that never turned them on.
            if not metrics_on():
                _process_recorder = NullRecorder()
            else:
                identity = job_identity()
                job = ensure_job_id(identity)
                _process_recorder = Recorder(
                    job_run_dir(identity, job), job=job, rank=identity.rank, attempt=identity.attempt
                )
                _process_recorder.process_launch()
                _run_hooks(_process_recorder)
        return _process_recorder


def existing_recorder() -> Recorder | NullRecorder | None:
    """The process-wide recorder if this process already asked for one, else ``None``; never builds
    one. For library code that adds detail to a job's events: a helper process (an Inductor compile
    worker) must not start recording, or its exit would speak for the job's attempt."""
    return _process_recorder


def reset_process_recorder() -> None:
    """Close and forget the process-wide recorder (the next :func:`get_recorder` reads the environment again)."""
    global _process_recorder
    with _process_lock:
        rec, _process_recorder = _process_recorder, None
    if rec is not None:
        rec.close()
    _undo_process_hooks()


# -- process hooks: exit, uncaught exceptions, SIGTERM, fork ------------------------------------------

_prev_excepthook = None
_prev_sigterm: Any = None


def _failure_category(exc: BaseException) -> str:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return "infra" if names & _INFRA_ERRORS else "user"


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    try:
        reason = f"{exc_type.__name__}: {exc}"[:500]
        for rec in list(_live):
            rec._last_words(reason, _failure_category(exc))
    except Exception:  # the original hook must run whatever happens here
        pass
    (_prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    try:
        for rec in list(_live):
            rec._last_words("SIGTERM", "preemption")
    except Exception:
        pass
    prev = _prev_sigterm
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        # Default action: die by the signal, so the parent sees the usual exit status.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _at_exit() -> None:
    for rec in list(_live):
        with contextlib.suppress(Exception):
            rec._at_exit()
    _undo_process_hooks(at_exit=True)  # after the last flush: a hook's last look sees the attempt's last events


# The flush locks each forking thread holds across its fork: per thread, since two threads may fork
# at once (a loader's workers on one, a helper process on another), and each releases only its own.
_at_fork = threading.local()
_FORK_LOCK_WAIT_S = 1.0


def _before_fork() -> None:
    # The flusher thread must not be half-way through a write when the process forks: the child would
    # inherit the buffer's popped records and the writer in that state. Holding every flush lock across
    # the fork makes it happen between two flushes (the lock is re-entrant: a fork from inside a flush
    # on this thread still goes through). Bounded: a write stuck on a dead file system delays a fork by
    # a second at most, and the child then starts with fresh locks and an empty buffer all the same.
    held: list[Any] = []
    _at_fork.held = held
    for rec in list(_live):
        try:
            lock = rec._flush_lock
            if lock.acquire(timeout=_FORK_LOCK_WAIT_S):
                held.append(lock)
        except Exception:  # noqa: BLE001 - a fork must never fail because of the metrics
            continue


def _after_fork_in_parent() -> None:
    held = getattr(_at_fork, "held", [])
    _at_fork.held = []
    while held:
        held.pop().release()


def _after_fork_in_child() -> None:
    _at_fork.held = []  # the child replaces the locks (held by the forking thread) with new ones
    for rec in list(_live):
        rec._after_fork_in_child()


def _install_process_hooks() -> None:
    global _hooks_installed, _prev_excepthook, _prev_sigterm
    with _hooks_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
        atexit.register(_at_exit)
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
        )
        _prev_excepthook = sys.excepthook
        sys.excepthook = _excepthook
        if threading.current_thread() is threading.main_thread():
            try:
                _prev_sigterm = signal.getsignal(signal.SIGTERM)
                signal.signal(signal.SIGTERM, _on_sigterm)
            except (ValueError, OSError):  # not allowed here (embedded interpreter): exit hooks still work
                _prev_sigterm = None
