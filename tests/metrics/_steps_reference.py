"""The slow-step analysis written the plain way (Python lists, sorted(), loops over every step): what
warmstart.metrics.steps must agree with on any timeline."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections import defaultdict
from collections.abc import Iterable

from warmstart.metrics.events import Begin, End, Event, Failure, Step, TrainEnd
from warmstart.metrics.steps import OUTLIER_MADS, TOP, Interrupted, Lag, RankLag, SlowStep, SlowSteps, margin_s


def trimmed_median(durations: Iterable[float]) -> float | None:
    """The median of ``durations`` left after dropping those above median + ``OUTLIER_MADS`` x MAD."""
    values = sorted(durations)
    if not values:
        return None
    mid = _median(values)
    mad = _median(sorted(map(abs, map(operator.sub, values, itertools.repeat(mid)))))
    return _median(values[: bisect.bisect_right(values, mid + OUTLIER_MADS * mad)])


def _median(ordered: list[float]) -> float:
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


def analyse_steps(events: Iterable[Event], rank: int | None = None) -> SlowSteps:
    """Slow steps and stragglers of one job's events (any order); see the module docstring for the rules.

    Args:
        events: the job's events.
        rank: the timeline rank whose durations are timed; by default rank 0, else the lowest rank.
    """
    events = events if isinstance(events, list) else list(events)
    # A job is nearly all steps: pick them out and group them in C-speed passes, the rest one by one.
    step_events = [ev for ev in events if type(ev) is Step]
    steps: dict[tuple[int, int], list[Step]] = defaultdict(list)
    for key, ev in zip(map(_attempt_rank, step_events), step_events, strict=True):
        steps[key].append(ev)
    train_ends: dict[tuple[int, int], float] = {}
    failures: dict[int, float] = {}
    span_marks: dict[int, list[tuple[float, int, tuple[int, str]]]] = defaultdict(list)
    for ev in [ev for ev in events if type(ev) is not Step]:
        kind = type(ev)
        if kind is Begin or kind is End:
            span_marks[ev.attempt].append((ev.ts, 1 if kind is Begin else -1, (ev.rank, ev.span)))
        elif kind is TrainEnd:
            key = (ev.attempt, ev.rank)
            train_ends[key] = min(ev.ts, train_ends.get(key, math.inf))
        elif kind is Failure:
            failures[ev.attempt] = min(ev.ts, failures.get(ev.attempt, math.inf))
    ranks = sorted({r for _, r in steps if r >= 0})
    if rank is None:
        rank = 0 if 0 in ranks else (ranks[0] if ranks else None)

    ends: dict[tuple[int, int], tuple[list[int], list[float]]] = {}  # (attempt, rank) -> step numbers, ends
    durations: list[float] = []  # of the timeline rank's steps, in order
    segments: list[tuple[int, int, list[int]]] = []  # per attempt: first index in durations, attempt, steps
    interrupted: list[Interrupted] = []
    for (attempt, r), seq in sorted(steps.items()):
        starts = [ev.ts for ev in seq]
        if any(map(operator.gt, starts, starts[1:])):  # events given out of time order
            seq.sort(key=_event_ts)
            starts = [ev.ts for ev in seq]
        job_end = train_ends.get((attempt, -1), train_ends.get((attempt, rank), math.inf))
        train_end = train_ends.get((attempt, r), job_end)
        failure = failures.get(attempt, math.inf)
        loop_end = min(train_end, failure)
        cut = bisect.bisect_left(starts, loop_end)
        if not cut:
            continue
        starts = starts[:cut]
        stops = starts[1:]
        if train_end <= failure and train_end < math.inf:
            stops.append(train_end)
        elif r == rank and failure < math.inf:
            interrupted.append(Interrupted(attempt, seq[cut - 1].step, failure - starts[-1]))
        numbers = [ev.step for ev in seq[: len(stops)]]
        ends[(attempt, r)] = (numbers, stops)
        if r == rank and stops:
            segments.append((len(durations), attempt, numbers))
            durations.extend(_net_durations(starts, stops, _union(span_marks.get(attempt, []), rank)))

    # Each attempt's first step is warm-up (lazy compilation, cold caches): not part of the ideal.
    bounds = [first for first, _, _ in segments] + [len(durations)]
    sample = (
        list(itertools.chain.from_iterable(durations[bounds[i] + 1 : bounds[i + 1]] for i in range(len(segments))))
        or durations
    )
    ideal = trimmed_median(sample)
    margin = margin_s(ideal)
    slow: list[SlowStep] = []
    if ideal is not None:
        for i in itertools.compress(range(len(durations)), map((ideal + margin).__lt__, durations)):
            first, attempt, numbers = segments[bisect.bisect_right(bounds, i) - 1]
            slow.append(SlowStep(attempt, numbers[i - first], durations[i], durations[i] - ideal))
    return SlowSteps(
        rank=rank if durations else None,
        measured_steps=len(durations),
        ideal_step_s=ideal,
        slow_above_s=None if ideal is None else ideal + margin,
        slow_count=len(slow),
        lost_s=math.fsum(s.excess_s for s in slow),
        slowest_steps=tuple(heapq.nlargest(TOP, slow, key=lambda s: s.excess_s)),
        slowest_ranks=_stragglers(ends, margin),
        interrupted=tuple(interrupted),
    )


_attempt_rank = operator.attrgetter("attempt", "rank")
_event_ts = operator.attrgetter("ts")


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


def _net_durations(starts: list[float], stops: list[float], covered: list[tuple[float, float]]) -> list[float]:
    """Each step's length (``starts[i]`` to ``stops[i]``, in time order) minus the part ``covered`` covers.
    Spans are few next to steps: each covered interval is taken out of the steps it overlaps."""
    out = [stop - start for start, stop in zip(starts, stops, strict=False)]
    for begin, end in covered:
        i = max(bisect.bisect_right(starts, begin) - 1, 0)
        while i < len(out) and starts[i] < end:
            inside = min(end, stops[i]) - max(begin, starts[i])
            if inside > 0:
                out[i] = max(out[i] - inside, 0.0)
            i += 1
    return out


def _stragglers(ends: dict[tuple[int, int], tuple[list[int], list[float]]], margin: float) -> tuple[RankLag, ...]:
    """The ranks whose steps ended last by more than ``margin``, most total lag first."""
    by_attempt: dict[int, dict[int, tuple[list[int], list[float]]]] = defaultdict(dict)
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
        if all(per_rank[r][0] == numbers for r in ranks[1:]):  # the usual case: every rank ran the same steps
            columns = [per_rank[r][1] for r in ranks]
        else:  # compare the steps every rank ended (one that died or joined late sits the rest out)
            by_step = [dict(zip(*per_rank[r], strict=True)) for r in ranks]
            numbers = sorted(set(by_step[0]).intersection(*by_step[1:]))
            columns = [[ends_of[n] for n in numbers] for ends_of in by_step]
        # A rank's lag at each step is its end minus the latest end of the other ranks; over the margin,
        # it was the last to end. Element-wise maps (C speed) over running maxima from both sides give
        # every rank's "other ranks" maximum in O(ranks x steps): a million steps cost no Python loop.
        for i, lag in enumerate(_lags(columns)):
            hits = list(itertools.compress(range(len(numbers)), map(margin.__lt__, lag)))
            if hits:
                r = ranks[i]
                counts[r] += len(hits)
                totals[r].append(math.fsum(map(lag.__getitem__, hits)))
                worst[r] = heapq.nlargest(
                    TOP,
                    itertools.chain(
                        worst[r],
                        ((lag[j], attempt, numbers[j]) for j in heapq.nlargest(TOP, hits, key=lag.__getitem__)),
                    ),
                )
    out = [RankLag(r, counts[r], math.fsum(totals[r]), tuple(Lag(a, n, lag) for lag, a, n in worst[r])) for r in counts]
    out.sort(key=lambda r: (-r.lag_s, r.rank))
    return tuple(out[:TOP])


def _lags(columns: list[list[float]]) -> list[list[float]]:
    """For each column (a rank's step ends), its values minus the element-wise maximum of the others."""
    before: list[list[float] | None] = []
    running: list[float] | None = None
    for column in columns:
        before.append(running)
        running = column if running is None else list(map(max, running, column))
    lags: list[list[float]] = [[] for _ in columns]
    running = None
    for i in reversed(range(len(columns))):
        left = before[i]
        others = running if left is None else left if running is None else map(max, left, running)
        lags[i] = list(map(operator.sub, columns[i], others))
        running = columns[i] if running is None else list(map(max, running, columns[i]))
    return lags
