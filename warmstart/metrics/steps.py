"""Slow steps and stragglers (docs/metrics.md#slow-steps-and-stragglers): a diagnostic beside ETT%.

From a job's ``step`` events: the ideal step time, the time lost to steps slower than it, and the ranks
the others waited for. It moves no second between buckets: a slow step's excess is still training
time (``effective_training``, or ``lost_progress`` for a lost step); this says how much of it a step at
the ideal time would not have taken. Pure: events in, one :class:`SlowSteps` out; the calculator
calls it, the reports show it. It knows nothing about buckets.

* A step runs from its ``step`` event to the same rank's next one in the same attempt; the last step
  of an attempt ends at ``train_end``. A step still running when its attempt failed never ended: it
  is listed apart (:attr:`SlowSteps.interrupted`), not timed. Steps at or after ``train_end`` or the
  attempt's first ``failure`` are shutdown or dead time, not steps.
* Durations are those of the job's timeline rank (rank 0, else the lowest), less the time that spans
  of that rank and of rank -1 cover (a checkpoint save or an eval inside a step is its own bucket).
* Ideal step time: the median of the durations left after dropping each attempt's first step
  (warm-up) and the outliers above median + 3 x MAD (a trimmed median).
* A step is slow when it takes longer than the ideal by more than ``SLOW_MARGIN`` of it (and at least
  ``MIN_MARGIN_S``); the time lost is the sum of the slow steps' durations minus the ideal.
* A rank lags at a step when its step ended later than every other rank's by more than that margin;
  the lag is how much later it ended than the next latest rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import operator
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, NamedTuple

from warmstart.metrics.events import Begin, End, Event, Failure, Step, TrainEnd

SLOW_MARGIN = 0.25  # a step more than 25% over the ideal is slow: jitter below that is not lost time
MIN_MARGIN_S = 0.001  # and more than 1 ms over it: timer noise on steps of a few milliseconds
OUTLIER_MADS = 3.0  # durations above median + 3 MAD are left out of the ideal
TOP = 10  # slowest steps, slowest ranks, and lagged steps per rank that are listed


@dataclasses.dataclass(frozen=True)
class SlowStep:
    """One step of the timeline rank that took longer than the ideal by more than the margin."""

    attempt: int
    step: int
    duration_s: float
    excess_s: float
    """``duration_s`` minus the ideal step time: the time lost to this step."""


@dataclasses.dataclass(frozen=True)
class Lag:
    """A step at which a rank ended later than every other rank."""

    attempt: int
    step: int
    lag_s: float
    """How much later than the next latest rank its step ended."""


@dataclasses.dataclass(frozen=True)
class RankLag:
    """A rank the others waited for: how often, how long, and its worst steps."""

    rank: int
    lagged_steps: int
    lag_s: float
    worst: tuple[Lag, ...]


@dataclasses.dataclass(frozen=True)
class Interrupted:
    """The step of the timeline rank that was running when its attempt failed."""

    attempt: int
    step: int
    running_s: float
    """From its ``step`` event to the failure (spans inside it not taken out)."""


@dataclasses.dataclass(frozen=True)
class SlowSteps:
    """Slow steps and stragglers of one job; the ``slow_steps`` object of ``warmstart ett report --json``."""

    rank: int | None
    """The rank whose step durations are timed (the job's timeline); ``None`` without steps."""
    measured_steps: int
    ideal_step_s: float | None
    slow_above_s: float | None
    """A step longer than this is slow: the ideal plus the margin."""
    slow_count: int
    lost_s: float
    slowest_steps: tuple[SlowStep, ...]
    slowest_ranks: tuple[RankLag, ...]
    interrupted: tuple[Interrupted, ...]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (tuples become lists)."""
        return dataclasses.asdict(self)


def margin_s(ideal_s: float | None) -> float:
    """How far over the ideal a step (or a rank's step end) may run before it counts."""
    return max(SLOW_MARGIN * ideal_s, MIN_MARGIN_S) if ideal_s is not None else MIN_MARGIN_S


def trimmed_median(durations: Iterable[float]) -> float | None:
    """The median of ``durations`` left after dropping those above median + ``OUTLIER_MADS`` x MAD."""
    import numpy as np

    values = np.asarray(durations if isinstance(durations, np.ndarray) else list(durations), dtype=float)
    if not len(values):
        return None
    mid = _median(np, values)
    mad = _median(np, np.abs(values - mid))
    return _median(np, values[values <= mid + OUTLIER_MADS * mad])


def _median(np: Any, values: Any) -> float:
    """The median of a non-empty 1-D array: its middle value, or the mean of the two middle ones."""
    half = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, half)[half])
    low, high = np.partition(values, (half - 1, half))[half - 1 : half + 1].tolist()
    return (low + high) / 2


def analyse_steps(events: Iterable[Event], rank: int | None = None) -> SlowSteps:
    """Slow steps and stragglers of one job's events (any order); see the module docstring for the rules.

    Args:
        events: the job's events.
        rank: the timeline rank whose durations are timed; by default rank 0, else the lowest rank.
    """
    import numpy as np  # here, not at the top: ``import warmstart.metrics`` stays light

    events = events if isinstance(events, list) else list(events)
    # A job is nearly all steps: pick them out and read their fields in C-speed passes, then work on
    # columns; the other events (spans, ends, failures) are few and go one by one.
    step_events = [ev for ev in events if type(ev) is Step]
    groups = _groups(np, step_events)
    if rank is None:
        rank = _timeline_rank(groups)
    timer = _StepTimer(np, step_events, _step_limits([ev for ev in events if type(ev) is not Step]), rank)
    for (attempt, group_rank), indices in groups:
        timer.time(attempt, group_rank, indices)
    durations = np.concatenate(timer.durations) if timer.durations else np.zeros(0)
    starts = [attempt.first for attempt in timer.attempts] + [timer.measured]
    ideal = _ideal_step_s(np, durations, starts)
    margin = margin_s(ideal)
    slow = _slow(np, durations, ideal, margin, timer.attempts, starts)
    return SlowSteps(
        rank=rank if timer.measured else None,
        measured_steps=timer.measured,
        ideal_step_s=ideal,
        slow_above_s=None if ideal is None else ideal + margin,
        slow_count=slow.slow_count,
        lost_s=slow.lost_s,
        slowest_steps=slow.slowest,
        slowest_ranks=_stragglers(np, timer.ends, margin),
        interrupted=tuple(timer.interrupted),
    )


def _timeline_rank(groups: list[tuple[tuple[int, int], Any]]) -> int | None:
    ranks = sorted({rank for (_, rank), _ in groups if rank >= 0})
    return 0 if 0 in ranks else (ranks[0] if ranks else None)


def _ideal_step_s(np: Any, durations: Any, starts: list[int]) -> float | None:
    """The trimmed median of ``durations`` (``starts``: each attempt's first index, then their count)."""
    # Each attempt's first step is warm-up (lazy compilation, cold caches): not part of the ideal.
    warm = [durations[first + 1 : end] for first, end in itertools.pairwise(starts)]
    sample = np.concatenate(warm or [durations])
    return trimmed_median(sample if len(sample) else durations)


class _StepLimits(NamedTuple):
    """What ends steps and what covers part of them: the events that are not steps."""

    train_ends: dict[tuple[int, int], float]
    """Per (attempt, rank), its first ``train_end``."""
    failures: dict[int, float]
    """Per attempt, its first ``failure``."""
    span_marks: dict[int, list[tuple[float, int, tuple[int, str]]]]
    """Per attempt, each span's begin (+1) and end (-1) as (time, +1 or -1, (rank, span name))."""


def _step_limits(other_events: list[Event]) -> _StepLimits:
    limits = _StepLimits({}, {}, defaultdict(list))
    for ev in other_events:
        if type(ev) is Begin or type(ev) is End:
            limits.span_marks[ev.attempt].append((ev.ts, 1 if type(ev) is Begin else -1, (ev.rank, ev.span)))
        elif type(ev) is TrainEnd:
            key = (ev.attempt, ev.rank)
            limits.train_ends[key] = min(ev.ts, limits.train_ends.get(key, math.inf))
        elif type(ev) is Failure:
            limits.failures[ev.attempt] = min(ev.ts, limits.failures.get(ev.attempt, math.inf))
    return limits


class _AttemptSteps(NamedTuple):
    """The timed steps of one attempt of the timeline rank."""

    first: int
    """Index of its first step's duration among all the timeline rank's durations."""
    attempt: int
    numbers: Any
    """Its step numbers, one per duration."""


class _StepTimer:
    """Times each (attempt, rank)'s steps, group by group: every rank's step ends (for stragglers), and
    the timeline rank's net durations (for slow steps)."""

    def __init__(self, np: Any, step_events: list[Step], limits: _StepLimits, timeline_rank: int | None) -> None:
        self.np = np
        self.step_events = step_events
        self.limits = limits
        self.timeline_rank = timeline_rank
        self.ts = np.fromiter(map(_ts, step_events), dtype=float, count=len(step_events))
        self.numbers = _int_column(np, step_events, _step)
        self.ends: dict[tuple[int, int], tuple[Any, Any]] = {}  # (attempt, rank) -> step numbers, step ends
        self.durations: list[Any] = []  # the timeline rank's net durations, per attempt
        self.attempts: list[_AttemptSteps] = []
        self.measured = 0
        self.interrupted: list[Interrupted] = []

    def time(self, attempt: int, rank: int, indices: Any) -> None:
        """Time one (attempt, rank)'s steps, given by their indices among the step events."""
        indices, starts = self._in_time_order(indices)
        train_end, failure = self._limits(attempt, rank)
        cut = int(self.np.searchsorted(starts, min(train_end, failure), "left"))
        if not cut:
            return
        starts = starts[:cut]
        if train_end <= failure and train_end < math.inf:
            stops = self.np.append(starts[1:], train_end)
        else:
            stops = starts[1:]
            if rank == self.timeline_rank and failure < math.inf:
                step = self.step_events[indices[cut - 1]].step
                self.interrupted.append(Interrupted(attempt, step, failure - float(starts[-1])))
        step_numbers = self.numbers[indices[: len(stops)]]
        self.ends[(attempt, rank)] = (step_numbers, stops)
        if rank == self.timeline_rank and len(stops):
            self.attempts.append(_AttemptSteps(self.measured, attempt, step_numbers))
            covered = _union(self.limits.span_marks.get(attempt, []), rank)
            self.durations.append(_net_durations(self.np, starts, stops, covered))
            self.measured += len(stops)

    def _in_time_order(self, indices: Any) -> tuple[Any, Any]:
        starts = self.ts[indices]
        if len(starts) > 1 and (starts[1:] < starts[:-1]).any():  # events given out of time order
            indices = indices[self.np.argsort(starts, kind="stable")]
            starts = self.ts[indices]
        return indices, starts

    def _limits(self, attempt: int, rank: int) -> tuple[float, float]:
        """Where the group's steps stop: its train_end (its own, else the job's, else the timeline
        rank's), and its attempt's failure."""
        train_ends = self.limits.train_ends
        timeline_end = (
            math.inf if self.timeline_rank is None else train_ends.get((attempt, self.timeline_rank), math.inf)
        )
        job_end = train_ends.get((attempt, -1), timeline_end)
        return train_ends.get((attempt, rank), job_end), self.limits.failures.get(attempt, math.inf)


class _Slow(NamedTuple):
    """The timeline rank's slow steps."""

    slow_count: int
    lost_s: float
    slowest: tuple[SlowStep, ...]


def _slow(
    np: Any, durations: Any, ideal: float | None, margin: float, attempts: list[_AttemptSteps], starts: list[int]
) -> _Slow:
    """The steps longer than ``ideal`` by more than ``margin``, and the slowest of them (``starts``: each
    attempt's first index among ``durations``, then their count)."""
    if ideal is None:
        return _Slow(0, 0.0, ())
    slow = np.flatnonzero(durations > ideal + margin)
    excess = durations[slow] - ideal
    slowest: list[SlowStep] = []
    for nth in np.argsort(-excess, kind="stable")[:TOP].tolist():  # the largest excess first, ties in order
        index = int(slow[nth])
        first, attempt, step_numbers = attempts[bisect.bisect_right(starts, index) - 1]
        step = int(step_numbers[index - first])
        slowest.append(SlowStep(attempt, step, float(durations[index]), float(excess[nth])))
    return _Slow(len(slow), math.fsum(excess.tolist()), tuple(slowest))


_ts = operator.attrgetter("ts")
_step = operator.attrgetter("step")
_attempt = operator.attrgetter("attempt")
_rank = operator.attrgetter("rank")


def _int_column(np: Any, step_events: list[Step], field: Any) -> Any:
    """One int field of ``step_events`` as an int64 array, or an object array if a value does not fit."""
    try:
        return np.fromiter(map(field, step_events), dtype=np.int64, count=len(step_events))
    except OverflowError:
        return np.array(list(map(field, step_events)), dtype=object)


def _groups(np: Any, step_events: list[Step]) -> list[tuple[tuple[int, int], Any]]:
    """The indices of ``step_events`` per (attempt, rank), in that order; each group keeps the events' order."""
    if not step_events:
        return []
    attempts = _int_column(np, step_events, _attempt)
    ranks = _int_column(np, step_events, _rank)
    if attempts.dtype == object or ranks.dtype == object:  # numbers past int64: group them one by one
        by_key: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, key in enumerate(zip(attempts.tolist(), ranks.tolist(), strict=True)):
            by_key[key].append(i)
        return [(key, np.array(by_key[key], dtype=np.intp)) for key in sorted(by_key)]
    a_min, r_min = int(attempts.min()), int(ranks.min())
    width = int(ranks.max()) - r_min + 1
    if (int(attempts.max()) - a_min + 1) * width <= 1 << 16:
        # Few (attempt, rank) pairs: a 16-bit key, which a stable sort orders in linear time.
        keys = ((attempts - a_min) * width + (ranks - r_min)).astype(np.uint16)
        order = np.argsort(keys, kind="stable")
    else:
        order = np.lexsort((ranks, attempts))  # stable too
    sorted_a, sorted_r = attempts[order], ranks[order]
    change = np.flatnonzero((sorted_a[1:] != sorted_a[:-1]) | (sorted_r[1:] != sorted_r[:-1])) + 1
    cuts = [0, *change.tolist(), len(order)]
    return [((int(sorted_a[lo]), int(sorted_r[lo])), order[lo:hi]) for lo, hi in itertools.pairwise(cuts)]


def _union(marks: list[tuple[float, int, tuple[int, str]]], rank: int | None) -> list[tuple[float, float]]:
    """The disjoint intervals that spans of ``rank`` and rank -1 cover, in time order. An ``end`` closes
    an open ``begin`` of the same rank and name (one without is ignored); one never closed runs on."""
    marks = sorted((m for m in marks if m[2][0] in (-1, rank)), key=operator.itemgetter(0))
    depth: dict[tuple[int, str], int] = defaultdict(int)
    covered: list[tuple[float, float]] = []
    open_spans, since = 0, 0.0
    for ts, delta, key in marks:
        if delta > 0:
            if not open_spans:
                since = ts
            depth[key] += 1
            open_spans += 1
        elif depth[key]:
            depth[key] -= 1
            open_spans -= 1
            if not open_spans:
                covered.append((since, ts))
    if open_spans:
        covered.append((since, math.inf))
    return covered


def _net_durations(np: Any, starts: Any, stops: Any, covered: list[tuple[float, float]]) -> Any:
    """Each step's length (``starts[i]`` to ``stops[i]``, in time order) minus the part ``covered`` covers.

    Every (covered interval, step) pair that overlaps is found with binary searches; a step that several
    intervals overlap loses their parts one after the other, in time order, as a loop over them would."""
    out = stops - starts[: len(stops)]
    if not covered or not len(out):
        return out
    begins = np.array([begin for begin, _ in covered])
    finishes = np.array([end for _, end in covered])
    first = np.maximum(np.searchsorted(starts, begins, "right") - 1, 0)
    counts = np.maximum(np.minimum(np.searchsorted(starts, finishes, "left"), len(out)) - first, 0)
    total = int(counts.sum())
    if not total:
        return out
    interval = np.repeat(np.arange(len(covered)), counts)
    step = np.arange(total) - np.repeat(np.cumsum(counts) - counts - first, counts)
    inside = np.minimum(finishes[interval], stops[step]) - np.maximum(begins[interval], starts[step])
    keep = np.flatnonzero(inside > 0)
    order = keep[np.argsort(step[keep], kind="stable")]  # per step, its intervals in time order
    step, inside = step[order], inside[order]
    while len(step):  # one round per interval a step overlaps: nearly always a single round
        lead = np.ones(len(step), dtype=bool)
        lead[1:] = step[1:] != step[:-1]
        out[step[lead]] = np.maximum(out[step[lead]] - inside[lead], 0.0)
        step, inside = step[~lead], inside[~lead]
    return out


def _stragglers(np: Any, ends: dict[tuple[int, int], tuple[Any, Any]], margin: float) -> tuple[RankLag, ...]:
    """The ranks whose steps ended last by more than ``margin``, most total lag first."""
    by_attempt: dict[int, dict[int, tuple[Any, Any]]] = defaultdict(dict)
    for (attempt, r), value in ends.items():
        if r >= 0:
            by_attempt[attempt][r] = value
    counts: dict[int, int] = defaultdict(int)
    totals: dict[int, list[float]] = defaultdict(list)
    worst: dict[int, list[tuple[float, int, int]]] = defaultdict(list)  # rank -> (lag, attempt, step)
    for attempt, per_rank in sorted(by_attempt.items()):
        if len(per_rank) < 2:
            continue
        ranks = sorted(per_rank)
        numbers = per_rank[ranks[0]][0]
        if all(np.array_equal(per_rank[r][0], numbers) for r in ranks[1:]):  # usual: every rank ran the same steps
            columns = np.vstack([per_rank[r][1] for r in ranks])
        else:  # compare the steps every rank ended (one that died or joined late sits the rest out)
            by_step = [_last_end_per_step(np, *per_rank[r]) for r in ranks]
            numbers = by_step[0][0]
            for unique, _ in by_step[1:]:
                if len(unique):
                    found = unique[np.minimum(np.searchsorted(unique, numbers), len(unique) - 1)]
                    numbers = numbers[found == numbers]
                else:
                    numbers = unique
            columns = np.vstack([stops[np.searchsorted(unique, numbers)] for unique, stops in by_step])
        # A rank's lag at each step is its end minus the latest end of the other ranks; over the margin,
        # it was the last to end. Running maxima from both sides give every rank's "other ranks" maximum.
        for i, lag in enumerate(_lags(np, columns)):
            hits = np.flatnonzero(lag > margin)
            if len(hits):
                r = ranks[i]
                counts[r] += len(hits)
                totals[r].append(math.fsum(lag[hits].tolist()))
                top = hits[np.argsort(-lag[hits], kind="stable")[:TOP]]  # the largest lags, ties in order
                worst[r] = heapq.nlargest(
                    TOP,
                    itertools.chain(
                        worst[r], zip(lag[top].tolist(), itertools.repeat(attempt), map(int, numbers[top]))
                    ),
                )
    out = [RankLag(r, counts[r], math.fsum(totals[r]), tuple(Lag(a, n, lag) for lag, a, n in worst[r])) for r in counts]
    out.sort(key=lambda r: (-r.lag_s, r.rank))
    return tuple(out[:TOP])


def _last_end_per_step(np: Any, numbers: Any, stops: Any) -> tuple[Any, Any]:
    """The distinct step numbers in ascending order, each with its last end (a step given twice)."""
    if len(numbers) < 2 or (numbers[1:] > numbers[:-1]).all():  # the usual case: already so
        return numbers, stops
    numbers, stops = numbers[::-1], stops[::-1]
    order = np.argsort(numbers, kind="stable")  # of equal numbers, the last end comes first
    numbers, stops = numbers[order], stops[order]
    lead = np.ones(len(numbers), dtype=bool)
    lead[1:] = numbers[1:] != numbers[:-1]
    return numbers[lead], stops[lead]


def _lags(np: Any, columns: Any) -> Any:
    """For each row (a rank's step ends), its values minus the element-wise maximum of the other rows."""
    before = np.maximum.accumulate(columns, axis=0)
    after = np.maximum.accumulate(columns[::-1], axis=0)[::-1]
    last = len(columns) - 1
    return [
        row - (after[1] if i == 0 else before[-2] if i == last else np.maximum(before[i - 1], after[i + 1]))
        for i, row in enumerate(columns)
    ]
