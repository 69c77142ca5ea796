"""The ETT calculator (docs/reference.md#events): events in, buckets out. Pure: no I/O but :func:`load_runs`.

Every second between a job's first ``attempt_start`` and its last ``attempt_end`` (or last event) lands
in exactly one bucket, so the buckets always sum to end-to-end time:

* Each attempt has a *window*, from its ``attempt_start`` (or first event) to its ``failure``, else its
  ``attempt_end`` (or last event), cut at the next attempt's start. Everything outside the windows
  (a failed attempt's remains, waiting to be rescheduled) is ``recovery_wait``.
* Inside a window, before the first ``step``: the named spans' buckets, each instant shared equally
  among the spans active then; uncovered time is ``init_other``. A span counts only inside its window:
  a ``process_launch`` that began before the ``attempt_start`` counts from it on.
* From a ``step`` to the next ``step`` (or the window's end, or ``train_end``): that step's training
  time minus the spans inside it (shared the same way; ``checkpoint_save`` is ``checkpoint_blocking``).
  The training time of a step numbered above the attempt's last ``checkpoint_committed`` step in an
  attempt that failed is ``lost_progress``; any other is ``effective_training``. Any rank's commits
  count, and so do those the next attempt recorded before its first step (what it loaded was durable,
  even when the failure cut off the commit's own event).
* From ``train_end`` to the window's end: ``shutdown``.

An attempt that is followed by another one but has neither a ``failure`` nor a ``train_end`` died
without saying so (``SIGKILL``, an OOM kill): it counts as a failure of category ``unknown``.
A span's time goes to its ``bucket`` field, else its name, mapped through the table in
``buckets.py`` (``checkpoint_save`` becomes ``checkpoint_blocking``). Ranks -1 and 0 (the lowest
rank when there is no rank 0) define the job's timeline; every rank's own spans and steps give its
per-rank breakdown over that same timeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import operator
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from warmstart.metrics.buckets import (
    CHECKPOINT_BLOCKING,
    EFFECTIVE,
    INIT_OTHER,
    LOST,
    PRELOAD_HANDOVER,
    RECOVERY,
    SHUTDOWN,
    STANDARD_BUCKETS,
    span_bucket,
)
from warmstart.metrics.events import (
    AttemptEnd,
    AttemptStart,
    Begin,
    CheckpointCommitted,
    End,
    Event,
    Failure,
    Step,
    TornLineWarning,
    TrainEnd,
    read_events,
)
from warmstart.metrics.event_files import event_files
from warmstart.metrics.steps import SlowSteps, analyse_steps
from warmstart.metrics.switches import CompileSwitch, compile_switches

if TYPE_CHECKING:
    from warmstart.metrics.windows import Window

# Event kinds are told apart by exact type (``type(ev) is Step``): an isinstance check on a struct
# class costs three times as much, which a million events notice.
_MAX_TIMELINE_STEPS = 2000  # step markers kept per attempt for charts; the buckets use every step


@dataclasses.dataclass
class Run:
    """The events of one job found in one run directory."""

    job: str
    run_dir: str
    events: list[Event]
    warnings: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SpanMark:
    """One span of the job's timeline, for charts."""

    name: str
    bucket: str
    start: float
    end: float
    rank: int


class Segment(NamedTuple):
    """A stretch of a timeline whose time goes to one bucket: ``share`` of each of its seconds (less than
    1 where overlapping spans split an instant). The segments of a run tile its end-to-end time, so any
    interval's buckets are the sum of its overlaps with them (``warmstart.metrics.windows``)."""

    start: float
    end: float
    bucket: str
    share: float
    attempt: int
    """Index into :attr:`RunResult.attempts` of the attempt whose buckets hold this time."""
    init: bool
    """Before the attempt's first step: part of its time to start or to recover."""


@dataclasses.dataclass
class AttemptTimeline:
    """What a chart of one attempt draws; times are unix seconds."""

    attempt: int
    start: float
    end: float
    first_step: float | None
    loop_end: float | None
    train_end: float | None
    lost_from: float | None
    failure: dict[str, Any] | None
    spans: list[SpanMark]
    steps: list[tuple[float, int]]
    checkpoints: list[tuple[float, int]]
    recovery_before: tuple[float, float] | None
    recovery_after: tuple[float, float] | None


@dataclasses.dataclass
class AttemptResult:
    """One attempt's own numbers; its buckets include the recovery wait just before it (and, for the
    job's last attempt, after it), so the attempts' buckets sum to the job's."""

    attempt: int
    start_ts: float
    end_ts: float
    devices: int
    e2e_s: float
    ett_pct: float
    buckets: dict[str, float]
    pre_first_step_s: float
    recovery_wait_s: float
    failed: bool
    failure: dict[str, Any] | None
    steps: int
    first_step: int | None
    last_step: int | None
    last_committed_step: int | None
    samples: int
    forked: bool = False
    """Its processes were forked by a preloader (a ``preload_handover`` span), not started anew."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (the ``attempts`` entries of docs/reference.md#report-json)."""
        d = dataclasses.asdict(self)
        d["lost_progress_s"] = self.buckets.get(LOST, 0.0)
        d["checkpoint_blocking_s"] = self.buckets.get(CHECKPOINT_BLOCKING, 0.0)
        d["shutdown_s"] = self.buckets.get(SHUTDOWN, 0.0)
        return d


@dataclasses.dataclass(frozen=True)
class RankResult:
    """One rank's own breakdown over the job's timeline."""

    e2e_s: float
    ett_pct: float | None
    """``None`` only for a report restricted to a time holding none of the job."""
    buckets: dict[str, float]


@dataclasses.dataclass
class RunResult:
    """ETT% of one job and its two-level breakdown: L1 figures and L2 buckets."""

    job: str
    run_dir: str
    start_ts: float
    end_ts: float
    e2e_s: float
    ett_pct: float | None
    """``None`` only for a report restricted to a time (``--since``/``--until``) holding none of the job."""
    devices: int
    buckets: dict[str, float]
    l1: dict[str, Any]
    attempts: list[AttemptResult]
    ranks: dict[int, RankResult]
    warnings: list[str]
    timeline: list[AttemptTimeline] = dataclasses.field(default_factory=list, repr=False)
    segments: list[Segment] = dataclasses.field(default_factory=list, repr=False)
    """The job's timeline as segments; filled only by ``compute(run, segments=True)``."""
    rank_segments: dict[int, list[Segment]] = dataclasses.field(default_factory=dict, repr=False)
    """Each rank's own segments, as :attr:`segments`."""
    windows: list[Window] | None = None
    """The ETT% of consecutive time windows, when a report asks for them (``warmstart.metrics.windows``)."""
    slow_steps: SlowSteps | None = None
    """Slow steps and stragglers (``warmstart.metrics.steps``), a diagnostic beside the buckets."""
    compile_switches: list[CompileSwitch] = dataclasses.field(default_factory=list)
    """Where each rank went from eager to compiled with background compiles (``warmstart.metrics.switches``)."""

    def to_dict(self) -> dict[str, Any]:
        """The ``warmstart ett report --json`` object of this run (docs/reference.md#report-json)."""
        d = {
            "job": self.job,
            "run_dir": self.run_dir,
            "e2e_s": self.e2e_s,
            "ett_pct": self.ett_pct,
            "devices": self.devices,
            "buckets": dict(self.buckets),
            "l1": dict(self.l1),
            "attempts": [a.to_dict() for a in self.attempts],
            "ranks": {str(rank): dataclasses.asdict(value) for rank, value in self.ranks.items()},
            "start_ts": self.start_ts,
            "end_ts": self.end_ts,
            "warnings": list(self.warnings),
            "slow_steps": self.slow_steps.to_dict() if self.slow_steps is not None else None,
            "compile_switches": [s.to_dict() for s in self.compile_switches],
        }
        if self.windows is not None:
            d["windows"] = [w.to_dict() for w in self.windows]
        return d


# -- loading -------------------------------------------------------------------------------------------


def load_runs(run_dirs: Iterable[str | os.PathLike]) -> list[Run]:
    """Read every ``*.jsonl`` file under each run directory and group the events by job.

    A run directory usually holds one job; if it holds several, each becomes its own :class:`Run`.
    Torn last lines are skipped and noted in :attr:`Run.warnings` (and warned about).

    Raises:
        EventFormatError: a directory is missing, or a line is malformed (file and line named).
    """
    runs: list[Run] = []
    for run_dir in run_dirs:
        with _gc_paused():
            runs.extend(_load_run_dir(run_dir))
    return runs


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    # A run builds millions of small objects that hold no cycles; the cyclic collector would walk them
    # again and again as they pile up (a third of the time of a 1M-event report).
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load_run_dir(run_dir: str | os.PathLike) -> list[Run]:
    runs: list[Run] = []
    by_job: dict[str, list[Event]] = defaultdict(list)
    notes: list[str] = []
    for path in event_files(run_dir):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TornLineWarning)
            events = read_events(path)
        for w in caught:
            notes.append(str(w.message))
            warnings.warn(str(w.message), TornLineWarning, stacklevel=2)
        jobs = set(map(operator.attrgetter("job"), events))
        if len(jobs) == 1:  # the usual case: one job per file
            by_job[jobs.pop()].extend(events)
        else:
            for ev in events:
                by_job[ev.job].append(ev)
    if not by_job:
        notes.append(f"{run_dir}: no events")
        runs.append(Run(job=Path(run_dir).name, run_dir=str(run_dir), events=[], warnings=notes))
    for job, events in by_job.items():
        runs.append(Run(job=job, run_dir=str(run_dir), events=events, warnings=list(notes)))
    return runs


# -- computing -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _RawAttempt:
    """What one attempt's own events say, before the windows are cut against each other."""

    attempt: int
    start: float
    end: float
    ended: bool  # it has an attempt_end
    failure: dict[str, Any] | None
    train_end: float | None
    committed: int | None
    devices: int


@dataclasses.dataclass
class _Frame:
    """One attempt's window on the job's timeline."""

    attempt: int
    start: float
    stop: float  # end of the working window (failure, attempt_end or last event, cut at next start)
    end: float  # attempt_end or last event (before cutting)
    failed: bool
    failure: dict[str, Any] | None
    train_end: float | None
    committed: int | None
    devices: int


def compute(run: Run, *, segments: bool = False, now: float | None = None) -> RunResult:
    """Split a job's wall time into buckets (docs/reference.md#events); see the module docstring for the rules.

    ``segments``: also keep the timeline as :class:`Segment` lists (:attr:`RunResult.segments`), which
    time windows need; off by default, as a plain report does not.
    ``now``: the job is still running at this unix time (the live exporter): its last attempt, when it
    has neither ended nor failed, runs until then instead of stopping at its last event.
    """
    with _gc_paused():
        return _compute(run, segments, now)


def _compute(run: Run, keep_segments: bool = False, now: float | None = None) -> RunResult:
    events = sorted(run.events, key=operator.attrgetter("ts"))
    notes = list(run.warnings)
    # A rank runs on a device of its own: a job's devices are at least its ranks, whatever its
    # attempt_start events say (each rank of the reference job declares its own one device).
    ranks_of: dict[int, set[int]] = defaultdict(set)
    for attempt, rank in {(e.attempt, e.rank) for e in events if e.rank >= 0}:
        ranks_of[attempt].add(rank)
    ranks = sorted(set().union(*ranks_of.values()))
    primary = 0 if 0 in ranks else (ranks[0] if ranks else -1)
    frame_events = [e for e in events if e.rank in (-1, primary)]
    frames = _frames(events, frame_events, notes, ranks_of, now)
    devices = max(max((e.devices for e in events if type(e) is AttemptStart and e.devices), default=1), len(ranks))
    if not frames:
        return RunResult(
            job=run.job,
            run_dir=run.run_dir,
            start_ts=0.0,
            end_ts=0.0,
            e2e_s=0.0,
            ett_pct=0.0,
            devices=devices,
            buckets=ordered_buckets({}),
            l1=_l1([], {}),
            attempts=[],
            ranks={},
            warnings=notes,
        )
    t0, t_end = frames[0].start, max(f.end for f in frames)

    job_segments: list[Segment] | None = [] if keep_segments else None
    rank_segments: dict[int, list[Segment]] = {}
    job_split = _split(frames, frame_events, t0, t_end, notes, keep_timeline=True, segments=job_segments)
    rank_results: dict[int, RankResult] = {}
    for rank in ranks:
        if rank == primary:
            split = job_split
            if job_segments is not None:
                rank_segments[rank] = job_segments
        else:
            own = [e for e in events if e.rank == rank]
            own_segments: list[Segment] | None = [] if keep_segments else None
            split = _split(frames, own, t0, t_end, notes, keep_timeline=False, segments=own_segments)
            if own_segments is not None:
                rank_segments[rank] = own_segments
        total = ordered_buckets(split.total)
        rank_results[rank] = RankResult(e2e_s=t_end - t0, ett_pct=_pct(total[EFFECTIVE], t_end - t0), buckets=total)

    forked = {e.attempt for e in events if type(e) is Begin and e.span == PRELOAD_HANDOVER}
    attempts = [_attempt_result(f, job_split, i, f.attempt in forked) for i, f in enumerate(frames)]
    buckets = ordered_buckets(job_split.total)
    e2e = t_end - t0
    return RunResult(
        job=run.job,
        run_dir=run.run_dir,
        start_ts=t0,
        end_ts=t_end,
        e2e_s=e2e,
        ett_pct=_pct(buckets[EFFECTIVE], e2e),
        devices=devices,
        buckets=buckets,
        l1=_l1(attempts, buckets),
        attempts=attempts,
        ranks=rank_results,
        warnings=notes,
        timeline=job_split.timeline,
        segments=job_segments or [],
        rank_segments=rank_segments,
        slow_steps=analyse_steps(events, primary),
        compile_switches=compile_switches(events),
    )


def compute_runs(run_dirs: Iterable[str | os.PathLike]) -> list[RunResult]:
    """:func:`load_runs` then :func:`compute` on each."""
    return [compute(run) for run in load_runs(run_dirs)]


def _frames(
    events: list[Event],
    frame_events: list[Event],
    notes: list[str],
    ranks_of: dict[int, set[int]],
    now: float | None = None,
) -> list[_Frame]:
    by_attempt: dict[int, list[Event]] = defaultdict(list)
    for ev in frame_events:
        by_attempt[ev.attempt].append(ev)
    for ev in events:  # an attempt that only other ranks saw still has a window
        if ev.attempt not in by_attempt:
            notes.append(f"attempt {ev.attempt}: no rank -1/0 events; its window comes from rank {ev.rank}")
            by_attempt[ev.attempt] = [e for e in events if e.attempt == ev.attempt]
    commits, loaded = _commits(events)
    raw: list[_RawAttempt] = []
    for attempt, evs in by_attempt.items():
        starts = [e.ts for e in evs if type(e) is AttemptStart]
        ends = [e.ts for e in evs if type(e) is AttemptEnd]
        start = min(starts) if starts else evs[0].ts
        end = max(ends) if ends else evs[-1].ts
        failures = [e for e in evs if type(e) is Failure]
        first_failure = failures[0] if failures else None
        train_ends = [e.ts for e in evs if type(e) is TrainEnd]
        raw.append(
            _RawAttempt(
                attempt=attempt,
                start=start,
                end=max(end, start),
                ended=bool(ends),
                failure=None
                if first_failure is None
                else {"ts": first_failure.ts, "reason": first_failure.reason, "category": first_failure.category},
                train_end=train_ends[0] if train_ends else None,
                committed=commits.get(attempt),
                devices=max(
                    max((e.devices or 1 for e in evs if type(e) is AttemptStart), default=1),
                    len(ranks_of.get(attempt, ())),
                ),
            )
        )
    raw.sort(key=lambda r: (r.start, r.attempt))
    # A failure can cut off the event of a commit that was already durable (a power cut between the
    # rename and the record): the checkpoint the next attempt loaded says so for it.
    for i, r in enumerate(raw[:-1]):
        vouched = loaded.get(raw[i + 1].attempt)
        if vouched is not None and (r.committed is None or vouched > r.committed):
            r.committed = vouched
    if now is not None and raw and not raw[-1].ended and raw[-1].failure is None:
        raw[-1].end = max(raw[-1].end, now)  # still running: its clock runs to the present
    frames: list[_Frame] = []
    cursor = raw[0].start if raw else 0.0
    for i, r in enumerate(raw):
        next_start = raw[i + 1].start if i + 1 < len(raw) else math.inf
        start = max(r.start, cursor)
        failure = r.failure
        if failure is None and r.train_end is None and next_start < math.inf:
            failure = {
                "ts": r.end,
                "reason": "attempt ended without failure or train_end events",
                "category": "unknown",
            }
        stop = min(failure["ts"] if failure else r.end, r.end, next_start)
        stop = max(stop, start)
        frames.append(
            _Frame(
                attempt=r.attempt,
                start=start,
                stop=stop,
                end=max(r.end, start),
                failed=failure is not None,
                failure=failure,
                train_end=r.train_end,
                committed=r.committed,
                devices=r.devices,
            )
        )
        cursor = max(stop, min(r.end, next_start))
    return frames


def _commits(events: list[Event]) -> tuple[dict[int, int], dict[int, int]]:
    """Per attempt, the highest ``checkpoint_committed`` step any rank recorded, and the highest one
    recorded before the attempt's first ``step`` (the checkpoint a restart loaded)."""
    first_step: dict[int, float] = {}
    for ev in events:
        if type(ev) is Step and ev.attempt not in first_step:
            first_step[ev.attempt] = ev.ts
    commits: dict[int, int] = {}
    loaded: dict[int, int] = {}
    for ev in events:
        if type(ev) is CheckpointCommitted:
            commits[ev.attempt] = max(commits.get(ev.attempt, ev.step), ev.step)
            if ev.ts < first_step.get(ev.attempt, math.inf):
                loaded[ev.attempt] = max(loaded.get(ev.attempt, ev.step), ev.step)
    return commits, loaded


@dataclasses.dataclass
class _Split:
    total: dict[str, float]
    per_attempt: list[dict[str, float]]
    pre_first_step: list[float]
    step_stats: list[tuple[int, int | None, int | None, int]]  # steps, first, last, samples
    timeline: list[AttemptTimeline]


def _split(
    frames: list[_Frame],
    events: list[Event],
    t0: float,
    t_end: float,
    notes: list[str],
    keep_timeline: bool,
    segments: list[Segment] | None = None,
) -> _Split:
    """Assign every instant of [t0, t_end] to a bucket, using ``events`` for spans and steps; with
    ``segments``, also append each stretch of time to it."""
    by_attempt: dict[int, list[Event]] = defaultdict(list)
    for ev in events:
        by_attempt[ev.attempt].append(ev)
    total: dict[str, float] = defaultdict(float)
    per_attempt: list[dict[str, float]] = []
    pre: list[float] = []
    stats: list[tuple[int, int | None, int | None, int]] = []
    timeline: list[AttemptTimeline] = []
    cursor = t0
    for i, frame in enumerate(frames):
        buckets: dict[str, float] = defaultdict(float)
        gap = max(frame.start - cursor, 0.0)
        if gap:
            buckets[RECOVERY] += gap
            if segments is not None:
                segments.append(Segment(cursor, frame.start, RECOVERY, 1.0, i, False))
        evs = by_attempt.get(frame.attempt, [])
        init_s, stat, tl = _fill_window(frame, evs, buckets, notes, keep_timeline, segments, i)
        pre.append(init_s)
        stats.append(stat)
        cursor = frame.stop
        if i == len(frames) - 1 and t_end > cursor:  # the job's tail after its last window
            buckets[RECOVERY] += t_end - cursor
            if segments is not None:
                segments.append(Segment(cursor, t_end, RECOVERY, 1.0, i, False))
            if tl is not None and frame.failed:
                tl.recovery_after = (cursor, t_end)
            cursor = t_end
        if tl is not None:
            tl.recovery_before = (frame.start - gap, frame.start) if gap else None
            timeline.append(tl)
        for name, seconds in buckets.items():
            total[name] += seconds
        per_attempt.append(buckets)
    return _Split(total, per_attempt, pre, stats, timeline)


# Sweep marks: at equal times, spans end before steps and spans begin after them.
_M_SPAN_END, _M_LOOP_END, _M_STEP, _M_SPAN_BEGIN = range(4)
_mark_order = operator.itemgetter(0, 1)


def _fill_window(
    frame: _Frame,
    evs: list[Event],
    buckets: dict[str, float],
    notes: list[str],
    keep_timeline: bool,
    segments: list[Segment] | None = None,
    index: int = 0,
) -> tuple[float, tuple, AttemptTimeline | None]:
    """Sweep one attempt's window; return its pre-first-step seconds, step stats and timeline.

    With ``segments``, each stretch the sweep attributes is also appended there (as attempt ``index``).
    """
    s, e = frame.start, frame.stop
    spans = _spans(evs, frame, notes)
    own_train_end = next((ev.ts for ev in evs if type(ev) is TrainEnd), None)
    train_end = own_train_end if own_train_end is not None else frame.train_end
    loop_end = e if train_end is None else min(max(train_end, s), e)
    # Steps after train_end belong to shutdown.
    steps = [ev for ev in evs if type(ev) is Step and s <= ev.ts < loop_end]
    first_step = steps[0].ts if steps else None
    committed = frame.committed
    failed = frame.failed

    marks: list[tuple[float, int, Any]] = []
    for b, en, bucket, _name, _rank in spans:
        marks.append((b, _M_SPAN_BEGIN, bucket))
        marks.append((en, _M_SPAN_END, bucket))
    # Only the steps where the training bucket changes matter to the sweep: the first one, and in a
    # failed attempt those that cross the last committed checkpoint (a million steps, a few marks).
    if steps and not failed:
        marks.append((steps[0].ts, _M_STEP, EFFECTIVE))
    elif steps:
        current = None
        for ev in steps:
            bucket = LOST if committed is None or ev.step > committed else EFFECTIVE
            if bucket is not current:
                marks.append((ev.ts, _M_STEP, bucket))
                current = bucket
    marks.append((loop_end, _M_LOOP_END, None))
    marks.append((e, _M_LOOP_END, None))
    marks.sort(key=_mark_order)

    active: dict[str, int] = defaultdict(int)
    nactive = 0
    phase = 0  # 0 init, 1 loop, 2 shutdown
    train_bucket = EFFECTIVE
    prev = s
    init_s = 0.0
    for t, kind, data in marks:
        if t > e:
            t = e
        d = t - prev
        if d > 0:
            if phase == 2:
                buckets[SHUTDOWN] += d
                if segments is not None:
                    segments.append(Segment(prev, t, SHUTDOWN, 1.0, index, False))
            elif nactive:
                for bucket, count in active.items():
                    if count:
                        buckets[bucket] += d * count / nactive
                        if segments is not None:
                            segments.append(Segment(prev, t, bucket, count / nactive, index, phase == 0))
            elif phase == 0:
                buckets[INIT_OTHER] += d
                if segments is not None:
                    segments.append(Segment(prev, t, INIT_OTHER, 1.0, index, True))
            else:
                buckets[train_bucket] += d
                if segments is not None:
                    segments.append(Segment(prev, t, train_bucket, 1.0, index, False))
            if phase == 0:
                init_s += d
            prev = t
        if kind == _M_SPAN_BEGIN:
            active[data] += 1
            nactive += 1
        elif kind == _M_SPAN_END:
            active[data] -= 1
            nactive -= 1
        elif kind == _M_STEP:
            phase = 1
            train_bucket = data
        elif t >= loop_end and phase != 2 and t < e:
            phase = 2
    tl = None
    if keep_timeline:
        lost_from = None
        if failed:
            lost_from = next((ev.ts for ev in steps if committed is None or ev.step > committed), None)
        stride = max(1, len(steps) // _MAX_TIMELINE_STEPS)
        tl = AttemptTimeline(
            attempt=frame.attempt,
            start=s,
            end=e,
            first_step=first_step,
            loop_end=loop_end if steps else None,
            train_end=train_end if train_end is not None and train_end < e else None,
            lost_from=lost_from,
            failure=frame.failure,
            spans=[SpanMark(name, bucket, b, en, rank) for b, en, bucket, name, rank in spans],
            steps=[(ev.ts, ev.step) for ev in steps[::stride]],
            # the attempt's own saves: a commit before its first step is the checkpoint it loaded
            checkpoints=[
                (ev.ts, ev.step)
                for ev in evs
                if type(ev) is CheckpointCommitted and first_step is not None and ev.ts >= first_step
            ],
            recovery_before=None,
            recovery_after=None,
        )
    stat = (
        len(steps),
        steps[0].step if steps else None,
        steps[-1].step if steps else None,
        sum([ev.samples for ev in steps if ev.samples]),
    )
    return init_s, stat, tl


def _spans(evs: list[Event], frame: _Frame, notes: list[str]) -> list[tuple[float, float, str, str, int]]:
    """Pair begin/end events per (rank, span name), innermost first; clip them to the window."""
    open_spans: dict[tuple[int, str], list[tuple[float, str | None]]] = defaultdict(list)
    spans: list[tuple[float, float, str, str, int]] = []
    s, e = frame.start, frame.stop
    for ev in evs:
        if type(ev) is Begin:
            open_spans[(ev.rank, ev.span)].append((ev.ts, ev.bucket))
        elif type(ev) is End:
            stack = open_spans.get((ev.rank, ev.span))
            if not stack:
                notes.append(
                    f"attempt {frame.attempt} rank {ev.rank}: 'end' of span {ev.span!r} without 'begin' ignored"
                )
                continue
            begin, bucket = stack.pop()
            spans.append((begin, ev.ts, span_bucket(ev.span, bucket or ev.bucket), ev.span, ev.rank))
    for (rank, name), stack in open_spans.items():
        for begin, bucket in stack:  # never ended: the attempt ended first
            spans.append((begin, e, span_bucket(name, bucket), name, rank))
    clipped = []
    for b, en, bucket, name, rank in spans:
        b, en = max(b, s), min(en, e)
        if en > b:
            clipped.append((b, en, bucket, name, rank))
    clipped.sort()
    return clipped


def _attempt_result(frame: _Frame, split: _Split, i: int, forked: bool) -> AttemptResult:
    buckets = ordered_buckets(split.per_attempt[i])
    e2e = sum(buckets.values())
    steps, first, last, samples = split.step_stats[i]
    failure = None if frame.failure is None else dict(frame.failure)
    return AttemptResult(
        attempt=frame.attempt,
        start_ts=frame.start,
        end_ts=frame.stop,
        devices=frame.devices,
        e2e_s=e2e,
        ett_pct=_pct(buckets[EFFECTIVE], e2e),
        buckets=buckets,
        pre_first_step_s=split.pre_first_step[i],
        recovery_wait_s=buckets[RECOVERY],
        failed=frame.failed,
        failure=failure,
        steps=steps,
        first_step=first,
        last_step=last,
        last_committed_step=frame.committed,
        samples=samples,
        forked=forked,
    )


def _l1(attempts: Sequence[AttemptResult], buckets: dict[str, float]) -> dict[str, Any]:
    by_category: dict[str, int] = defaultdict(int)
    for a in attempts:
        if a.failed and a.failure:
            by_category[a.failure["category"]] += 1
    return {
        "time_to_start_s": attempts[0].pre_first_step_s if attempts else 0.0,
        "time_to_recover_s": sum(a.pre_first_step_s for a in attempts[1:]) + buckets.get(RECOVERY, 0.0),
        "failures": sum(by_category.values()),
        "failures_by_category": dict(sorted(by_category.items())),
        "lost_progress_s": buckets.get(LOST, 0.0),
        "checkpoint_blocking_s": buckets.get(CHECKPOINT_BLOCKING, 0.0),
        "shutdown_s": buckets.get(SHUTDOWN, 0.0),
    }


def ordered_buckets(buckets: dict[str, float]) -> dict[str, float]:
    """``buckets`` with every standard bucket present (0 when absent), standard ones first."""
    out = {name: float(buckets.get(name, 0.0)) for name in STANDARD_BUCKETS}
    for name in sorted(buckets):
        if name not in out:
            out[name] = float(buckets[name])
    return out


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0
