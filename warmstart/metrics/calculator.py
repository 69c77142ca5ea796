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
import itertools
import math
import operator
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

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
from warmstart.metrics.event_files import event_files
from warmstart.metrics.events import (
    AttemptEnd,
    AttemptStart,
    Begin,
    CheckpointCommitted,
    End,
    Event,
    Failure,
    Resume,
    Step,
    TornLineWarning,
    TrainEnd,
    read_events,
)
from warmstart.metrics.steps import SlowSteps, analyse_steps
from warmstart.metrics.switches import CompileSwitch, compile_switches
from warmstart.metrics.window_results import Window

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
    resumed: dict[str, Any] | None = None
    """``{"step": S, "source": ...}``: where it went on from (its ``resume`` event; ``None`` without)."""

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
    window_end: float
    """Where its working window ends: its failure, else its ``attempt_end`` (or last event), cut at the
    next attempt's start. Time after it is the next recovery wait."""
    attempt_end: float
    """Its ``attempt_end`` (or last event), not cut: the job ends at the latest of these."""
    failed: bool
    failure: dict[str, Any] | None
    train_end: float | None
    committed: int | None
    devices: int


class _JobWindows(NamedTuple):
    """The attempts' windows and the job's end-to-end time they lie in."""

    frames: list[_Frame]
    start: float
    end: float


class _StepStats(NamedTuple):
    """The steps an attempt's window counted as training."""

    steps: int
    first: int | None
    last: int | None
    samples: int


class _Span(NamedTuple):
    """A span clipped to its attempt's window (sorted by start, then end)."""

    start: float
    end: float
    bucket: str
    name: str
    rank: int


class _Mark(NamedTuple):
    """A point of one window's sweep where the bucket that time goes to may change."""

    ts: float
    kind: int
    bucket: str
    """The span's or the training time's bucket; empty for the loop's and the window's ends."""


class _TrainingLoop(NamedTuple):
    """Where one attempt's window trains: from its first step to its ``train_end`` (else the window's end)."""

    steps: list[Step]
    """The steps before the loop's end: those after ``train_end`` are shutdown."""
    train_end: float | None
    """The attempt's ``train_end``, from the swept rank's events, else the job's timeline."""
    end: float


class _WindowSplit(NamedTuple):
    """What sweeping one attempt's window gives beside its buckets."""

    pre_first_step_s: float
    step_stats: _StepStats
    timeline: AttemptTimeline | None


def compute(run: Run, *, segments: bool = False, now: float | None = None) -> RunResult:
    """Split a job's wall time into buckets (docs/reference.md#events); see the module docstring for the rules.

    ``segments``: also keep the timeline as :class:`Segment` lists (:attr:`RunResult.segments`), which
    time windows need; off by default, as a plain report does not.
    ``now``: the job is still running at this unix time (the live exporter): its last attempt, when it
    has neither ended nor failed, runs until then instead of stopping at its last event.
    """
    with _gc_paused():
        return _compute(run, segments, now)


def compute_runs(run_dirs: Iterable[str | os.PathLike]) -> list[RunResult]:
    """:func:`load_runs` then :func:`compute` on each."""
    return [compute(run) for run in load_runs(run_dirs)]


def _compute(run: Run, keep_segments: bool = False, now: float | None = None) -> RunResult:
    events = sorted(run.events, key=operator.attrgetter("ts"))
    notes = list(run.warnings)
    ranks_of = _ranks_by_attempt(events)
    ranks = sorted(set().union(*ranks_of.values()))
    primary = _timeline_rank(ranks)
    frame_events = [ev for ev in events if ev.rank in (-1, primary)]
    frames = _frames(events, frame_events, notes, ranks_of, now)
    devices = _job_devices(events, ranks)
    if not frames:
        return _empty_result(run, devices, notes)
    job = _JobWindows(frames, frames[0].start, max(frame.attempt_end for frame in frames))

    # Segments first (each attempt's window swept into buckets), then the job's buckets from them.
    job_segments: list[Segment] | None = [] if keep_segments else None
    job_split = _split(job, frame_events, notes, keep_timeline=True, segments=job_segments)
    rank_results: dict[int, RankResult] = {}
    rank_segments: dict[int, list[Segment]] = {}
    for rank in ranks:
        if rank == primary:  # the job's own timeline, already swept
            split, segments = job_split, job_segments
        else:
            split, segments = _rank_split(job, events, rank, notes, keep_segments)
        rank_results[rank] = _rank_result(job, split)
        if segments is not None:
            rank_segments[rank] = segments

    forked = _forked_attempts(events)
    resumes = _resumes(events)
    attempts = [
        _attempt_result(frame, job_split, index, frame.attempt in forked, resumes.get(frame.attempt))
        for index, frame in enumerate(frames)
    ]
    buckets = ordered_buckets(job_split.total)
    e2e = job.end - job.start
    return RunResult(
        job=run.job,
        run_dir=run.run_dir,
        start_ts=job.start,
        end_ts=job.end,
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


def _timeline_rank(ranks: list[int]) -> int:
    """Rank 0, else the lowest rank; -1 for a job whose events are all the launcher's."""
    return 0 if 0 in ranks else (ranks[0] if ranks else -1)


def _job_devices(events: list[Event], ranks: list[int]) -> int:
    declared = max((ev.devices for ev in events if type(ev) is AttemptStart and ev.devices), default=1)
    return max(declared, len(ranks))


def _forked_attempts(events: list[Event]) -> set[int]:
    return {ev.attempt for ev in events if type(ev) is Begin and ev.span == PRELOAD_HANDOVER}


def _ranks_by_attempt(events: list[Event]) -> dict[int, set[int]]:
    # A rank runs on a device of its own: a job's devices are at least its ranks, whatever its
    # attempt_start events say (each rank of the reference job declares its own one device).
    ranks_of: dict[int, set[int]] = defaultdict(set)
    for attempt, rank in {(ev.attempt, ev.rank) for ev in events if ev.rank >= 0}:
        ranks_of[attempt].add(rank)
    return ranks_of


def _empty_result(run: Run, devices: int, notes: list[str]) -> RunResult:
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


def _rank_split(
    job: _JobWindows, events: list[Event], rank: int, notes: list[str], keep_segments: bool
) -> tuple[_Split, list[Segment] | None]:
    """One rank's own breakdown over the job's windows, and its segments when they are kept."""
    own = [ev for ev in events if ev.rank == rank]
    segments: list[Segment] | None = [] if keep_segments else None
    return _split(job, own, notes, keep_timeline=False, segments=segments), segments


def _rank_result(job: _JobWindows, split: _Split) -> RankResult:
    total = ordered_buckets(split.total)
    return RankResult(e2e_s=job.end - job.start, ett_pct=_pct(total[EFFECTIVE], job.end - job.start), buckets=total)


# -- the attempts' windows -----------------------------------------------------------------------------


def _frames(
    events: list[Event],
    frame_events: list[Event],
    notes: list[str],
    ranks_of: dict[int, set[int]],
    now: float | None = None,
) -> list[_Frame]:
    """Each attempt's window, in time order: what its own events say, then cut against the others'."""
    by_attempt = _events_by_attempt(events, frame_events, notes)
    commits, loaded = _commits(events)
    raw = [
        _raw_attempt(attempt, evs, commits.get(attempt), len(ranks_of.get(attempt, ())))
        for attempt, evs in by_attempt.items()
    ]
    raw.sort(key=lambda attempt: (attempt.start, attempt.attempt))
    _vouch_for_commits(raw, loaded)
    if now is not None and raw and not raw[-1].ended and raw[-1].failure is None:
        raw[-1].end = max(raw[-1].end, now)  # still running: its clock runs to the present
    return _cut_windows(raw)


def _events_by_attempt(events: list[Event], frame_events: list[Event], notes: list[str]) -> dict[int, list[Event]]:
    by_attempt: dict[int, list[Event]] = defaultdict(list)
    for ev in frame_events:
        by_attempt[ev.attempt].append(ev)
    for ev in events:  # an attempt that only other ranks saw still has a window
        if ev.attempt not in by_attempt:
            notes.append(f"attempt {ev.attempt}: no rank -1/0 events; its window comes from rank {ev.rank}")
            by_attempt[ev.attempt] = [other for other in events if other.attempt == ev.attempt]
    return by_attempt


def _raw_attempt(attempt: int, evs: list[Event], committed: int | None, ranks: int) -> _RawAttempt:
    starts = [ev.ts for ev in evs if type(ev) is AttemptStart]
    ends = [ev.ts for ev in evs if type(ev) is AttemptEnd]
    start = min(starts, default=evs[0].ts)
    end = max(ends, default=evs[-1].ts)
    declared_devices = max((ev.devices or 1 for ev in evs if type(ev) is AttemptStart), default=1)
    return _RawAttempt(
        attempt=attempt,
        start=start,
        end=max(end, start),
        ended=bool(ends),
        failure=_first_failure(evs),
        train_end=next((ev.ts for ev in evs if type(ev) is TrainEnd), None),
        committed=committed,
        devices=max(declared_devices, ranks),
    )


def _first_failure(evs: list[Event]) -> dict[str, Any] | None:
    failure = next((ev for ev in evs if type(ev) is Failure), None)
    if failure is None:
        return None
    return {"ts": failure.ts, "reason": failure.reason, "category": failure.category}


def _vouch_for_commits(raw: list[_RawAttempt], loaded: dict[int, int]) -> None:
    # A failure can cut off the event of a commit that was already durable (a power cut between the
    # rename and the record): the checkpoint the next attempt loaded says so for it.
    for attempt, next_attempt in itertools.pairwise(raw):
        vouched = loaded.get(next_attempt.attempt)
        if vouched is not None and (attempt.committed is None or vouched > attempt.committed):
            attempt.committed = vouched


def _cut_windows(raw: list[_RawAttempt]) -> list[_Frame]:
    """The attempts' windows (``raw`` in time order), each cut at the next one's start."""
    frames: list[_Frame] = []
    cursor = raw[0].start if raw else 0.0
    for index, attempt in enumerate(raw):
        next_start = raw[index + 1].start if index + 1 < len(raw) else math.inf
        start = max(attempt.start, cursor)
        failure = _failure_of(attempt, next_start)
        window_end = min(failure["ts"] if failure else attempt.end, attempt.end, next_start)
        window_end = max(window_end, start)
        frames.append(
            _Frame(
                attempt=attempt.attempt,
                start=start,
                window_end=window_end,
                attempt_end=max(attempt.end, start),
                failed=failure is not None,
                failure=failure,
                train_end=attempt.train_end,
                committed=attempt.committed,
                devices=attempt.devices,
            )
        )
        cursor = max(window_end, min(attempt.end, next_start))
    return frames


def _failure_of(attempt: _RawAttempt, next_start: float) -> dict[str, Any] | None:
    """Its ``failure``; one followed by another attempt without a ``failure`` or ``train_end`` died
    without saying so."""
    if attempt.failure is None and attempt.train_end is None and next_start < math.inf:
        return {
            "ts": attempt.end,
            "reason": "attempt ended without failure or train_end events",
            "category": "unknown",
        }
    return attempt.failure


def _resumes(events: list[Event]) -> dict[int, dict[str, Any]]:
    """Per attempt, where it went on from: the lowest step any rank's ``resume`` names (every rank
    restored at least that much), with that rank's source."""
    out: dict[int, dict[str, Any]] = {}
    for ev in events:
        if type(ev) is Resume and (ev.attempt not in out or ev.step < out[ev.attempt]["step"]):
            out[ev.attempt] = {"step": ev.step, "source": ev.source}
    return out


def _commits(events: list[Event]) -> tuple[dict[int, int], dict[int, int]]:
    """Per attempt, the highest ``checkpoint_committed`` step any rank recorded, and the highest one
    recorded before the attempt's first ``step`` (the checkpoint a restart loaded) or named by its
    ``resume`` (what it restored, from a checkpoint or a snapshot)."""
    first_step: dict[int, float] = {}
    for ev in events:
        if type(ev) is Step and ev.attempt not in first_step:
            first_step[ev.attempt] = ev.ts
    commits: dict[int, int] = {}
    loaded: dict[int, int] = {}
    for ev in events:
        if type(ev) is Resume:  # what a restart restored (a checkpoint or a snapshot) was kept
            loaded[ev.attempt] = max(loaded.get(ev.attempt, ev.step), ev.step)
        elif type(ev) is CheckpointCommitted:
            commits[ev.attempt] = max(commits.get(ev.attempt, ev.step), ev.step)
            if ev.ts < first_step.get(ev.attempt, math.inf):
                loaded[ev.attempt] = max(loaded.get(ev.attempt, ev.step), ev.step)
    return commits, loaded


# -- sweeping the windows into buckets -----------------------------------------------------------------


@dataclasses.dataclass
class _Split:
    total: dict[str, float]
    per_attempt: list[dict[str, float]]
    pre_first_step: list[float]
    step_stats: list[_StepStats]
    timeline: list[AttemptTimeline]


@dataclasses.dataclass
class _Tally:
    """Where one attempt's swept time goes: its buckets, and the job's segments when they are kept."""

    buckets: dict[str, float]
    segments: list[Segment] | None
    attempt_index: int
    """The attempt's position in the job's windows (what a :class:`Segment` names)."""

    def add(
        self, start: float, end: float, bucket: str, seconds: float, share: float = 1.0, init: bool = False
    ) -> None:
        self.buckets[bucket] += seconds
        if self.segments is not None:
            self.segments.append(Segment(start, end, bucket, share, self.attempt_index, init))


def _split(
    job: _JobWindows,
    events: list[Event],
    notes: list[str],
    *,
    keep_timeline: bool,
    segments: list[Segment] | None = None,
) -> _Split:
    """Assign every instant of the job's time to a bucket, using ``events`` for spans and steps; with
    ``segments``, also append each stretch of time to it."""
    by_attempt: dict[int, list[Event]] = defaultdict(list)
    for ev in events:
        by_attempt[ev.attempt].append(ev)
    split = _Split(defaultdict(float), [], [], [], [])
    cursor = job.start
    last = len(job.frames) - 1
    for index, frame in enumerate(job.frames):
        tally = _Tally(defaultdict(float), segments, index)
        waited = max(frame.start - cursor, 0.0)
        if waited:
            tally.add(cursor, frame.start, RECOVERY, waited)
        window = _fill_window(frame, by_attempt.get(frame.attempt, []), tally, notes, keep_timeline)
        cursor = frame.window_end
        if index == last and job.end > cursor:  # the job's tail after its last window
            tally.add(cursor, job.end, RECOVERY, job.end - cursor)
            if window.timeline is not None and frame.failed:
                window.timeline.recovery_after = (cursor, job.end)
            cursor = job.end
        if window.timeline is not None:
            window.timeline.recovery_before = (frame.start - waited, frame.start) if waited else None
            split.timeline.append(window.timeline)
        for name, seconds in tally.buckets.items():
            split.total[name] += seconds
        split.per_attempt.append(tally.buckets)
        split.pre_first_step.append(window.pre_first_step_s)
        split.step_stats.append(window.step_stats)
    return split


# Sweep marks: at equal times, spans end before steps and spans begin after them.
_M_SPAN_END, _M_LOOP_END, _M_STEP, _M_SPAN_BEGIN = range(4)
_mark_order = operator.itemgetter(0, 1)
# The phases of a window: before the first step, the training loop, after train_end.
_INIT, _LOOP, _SHUTDOWN = range(3)


def _fill_window(frame: _Frame, evs: list[Event], tally: _Tally, notes: list[str], keep_timeline: bool) -> _WindowSplit:
    """Sweep one attempt's window into ``tally``; return its pre-first-step seconds, step stats and timeline."""
    spans = _spans(evs, frame, notes)
    loop = _training_loop(frame, evs)
    sweep = _Sweep(frame.start, tally)
    for mark in _marks(frame, spans, loop):
        sweep.advance(mark, loop.end, frame.window_end)
    timeline = _attempt_timeline(frame, evs, spans, loop) if keep_timeline else None
    return _WindowSplit(sweep.init_s, _step_stats(loop.steps), timeline)


def _training_loop(frame: _Frame, evs: list[Event]) -> _TrainingLoop:
    own_train_end = next((ev.ts for ev in evs if type(ev) is TrainEnd), None)
    train_end = own_train_end if own_train_end is not None else frame.train_end
    end = frame.window_end if train_end is None else min(max(train_end, frame.start), frame.window_end)
    # Steps after train_end belong to shutdown.
    steps = [ev for ev in evs if type(ev) is Step and frame.start <= ev.ts < end]
    return _TrainingLoop(steps, train_end, end)


def _marks(frame: _Frame, spans: list[_Span], loop: _TrainingLoop) -> list[_Mark]:
    """The sweep's marks in order: each span's begin and end, the steps where training time changes
    bucket, the loop's end and the window's end."""
    marks: list[_Mark] = []
    for span in spans:
        marks.append(_Mark(span.start, _M_SPAN_BEGIN, span.bucket))
        marks.append(_Mark(span.end, _M_SPAN_END, span.bucket))
    # Only the steps where the training bucket changes matter to the sweep: the first one, and in a
    # failed attempt those that cross the last committed checkpoint (a million steps, a few marks).
    if loop.steps and not frame.failed:
        marks.append(_Mark(loop.steps[0].ts, _M_STEP, EFFECTIVE))
    elif loop.steps:
        current = None
        for ev in loop.steps:
            bucket = _training_bucket(ev, frame.committed)
            if bucket is not current:
                marks.append(_Mark(ev.ts, _M_STEP, bucket))
                current = bucket
    marks.append(_Mark(loop.end, _M_LOOP_END, ""))
    marks.append(_Mark(frame.window_end, _M_LOOP_END, ""))
    marks.sort(key=_mark_order)
    return marks


def _training_bucket(step: Step, committed: int | None) -> str:
    """Where a failed attempt's step goes: lost unless a committed checkpoint holds it."""
    return LOST if committed is None or step.step > committed else EFFECTIVE


class _Sweep:
    """One window swept mark by mark: the time since the last mark goes to the buckets of what was
    active over it (the spans, sharing each instant equally; else the phase's own bucket)."""

    def __init__(self, start: float, tally: _Tally) -> None:
        self.tally = tally
        self.since = start
        self.phase = _INIT
        self.train_bucket = EFFECTIVE
        self.active: dict[str, int] = defaultdict(int)  # bucket -> spans open in it
        self.active_count = 0
        self.init_s = 0.0

    def advance(self, mark: _Mark, loop_end: float, window_end: float) -> None:
        ts = min(mark.ts, window_end)
        self._attribute(ts)
        if mark.kind == _M_SPAN_BEGIN:
            self.active[mark.bucket] += 1
            self.active_count += 1
        elif mark.kind == _M_SPAN_END:
            self.active[mark.bucket] -= 1
            self.active_count -= 1
        elif mark.kind == _M_STEP:
            self.phase = _LOOP
            self.train_bucket = mark.bucket
        elif loop_end <= ts < window_end and self.phase != _SHUTDOWN:
            self.phase = _SHUTDOWN

    def _attribute(self, until: float) -> None:
        """Give the time from the last mark to ``until`` to its buckets."""
        seconds = until - self.since
        if seconds <= 0:
            return
        start, init = self.since, self.phase == _INIT
        if self.phase == _SHUTDOWN:
            self.tally.add(start, until, SHUTDOWN, seconds)
        elif self.active_count:
            for bucket, count in self.active.items():
                if count:
                    share = count / self.active_count
                    self.tally.add(start, until, bucket, seconds * count / self.active_count, share, init)
        elif init:
            self.tally.add(start, until, INIT_OTHER, seconds, init=True)
        else:
            self.tally.add(start, until, self.train_bucket, seconds)
        if init:
            self.init_s += seconds
        self.since = until


def _step_stats(steps: list[Step]) -> _StepStats:
    return _StepStats(
        steps=len(steps),
        first=steps[0].step if steps else None,
        last=steps[-1].step if steps else None,
        samples=sum([ev.samples for ev in steps if ev.samples]),
    )


def _attempt_timeline(frame: _Frame, evs: list[Event], spans: list[_Span], loop: _TrainingLoop) -> AttemptTimeline:
    steps, train_end = loop.steps, loop.train_end
    first_step = steps[0].ts if steps else None
    lost_from = None
    if frame.failed:
        lost_from = next((ev.ts for ev in steps if _training_bucket(ev, frame.committed) == LOST), None)
    stride = max(1, len(steps) // _MAX_TIMELINE_STEPS)
    return AttemptTimeline(
        attempt=frame.attempt,
        start=frame.start,
        end=frame.window_end,
        first_step=first_step,
        loop_end=loop.end if steps else None,
        train_end=train_end if train_end is not None and train_end < frame.window_end else None,
        lost_from=lost_from,
        failure=frame.failure,
        spans=[SpanMark(span.name, span.bucket, span.start, span.end, span.rank) for span in spans],
        steps=[(ev.ts, ev.step) for ev in steps[::stride]],
        checkpoints=_own_saves(evs, first_step),
        recovery_before=None,
        recovery_after=None,
    )


def _own_saves(evs: list[Event], first_step: float | None) -> list[tuple[float, int]]:
    # A commit before the attempt's first step is the checkpoint it loaded, not one it saved.
    if first_step is None:
        return []
    return [(ev.ts, ev.step) for ev in evs if type(ev) is CheckpointCommitted and ev.ts >= first_step]


def _spans(evs: list[Event], frame: _Frame, notes: list[str]) -> list[_Span]:
    """Pair begin/end events per (rank, span name), innermost first; clip them to the window."""
    open_spans: dict[tuple[int, str], list[tuple[float, str | None]]] = defaultdict(list)
    spans: list[_Span] = []
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
            spans.append(_Span(begin, ev.ts, span_bucket(ev.span, bucket or ev.bucket), ev.span, ev.rank))
    for (rank, name), stack in open_spans.items():
        for begin, bucket in stack:  # never ended: the attempt ended first
            spans.append(_Span(begin, frame.window_end, span_bucket(name, bucket), name, rank))
    clipped = []
    for span in spans:
        start, end = max(span.start, frame.start), min(span.end, frame.window_end)
        if end > start:
            clipped.append(span._replace(start=start, end=end))
    clipped.sort()
    return clipped


def _attempt_result(
    frame: _Frame, split: _Split, index: int, forked: bool, resumed: dict[str, Any] | None
) -> AttemptResult:
    buckets = ordered_buckets(split.per_attempt[index])
    e2e = sum(buckets.values())
    stats = split.step_stats[index]
    failure = None if frame.failure is None else dict(frame.failure)
    return AttemptResult(
        attempt=frame.attempt,
        start_ts=frame.start,
        end_ts=frame.window_end,
        devices=frame.devices,
        e2e_s=e2e,
        ett_pct=_pct(buckets[EFFECTIVE], e2e),
        buckets=buckets,
        pre_first_step_s=split.pre_first_step[index],
        recovery_wait_s=buckets[RECOVERY],
        failed=frame.failed,
        failure=failure,
        steps=stats.steps,
        first_step=stats.first,
        last_step=stats.last,
        last_committed_step=frame.committed,
        samples=stats.samples,
        forked=forked,
        resumed=resumed,
    )


def _l1(attempts: Sequence[AttemptResult], buckets: dict[str, float]) -> dict[str, Any]:
    by_category: dict[str, int] = defaultdict(int)
    for attempt in attempts:
        if attempt.failed and attempt.failure:
            by_category[attempt.failure["category"]] += 1
    return {
        "time_to_start_s": attempts[0].pre_first_step_s if attempts else 0.0,
        "time_to_recover_s": sum(attempt.pre_first_step_s for attempt in attempts[1:]) + buckets.get(RECOVERY, 0.0),
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
