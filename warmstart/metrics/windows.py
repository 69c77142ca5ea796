"""Time windows over ETT results: restrict a report to an interval, leave ranges out (maintenance
windows), and slice the time into consecutive windows, each with its own ETT% and buckets.

It works on the calculator's segments (``compute(run, segments=True)``), a job's timeline as stretches
of time that each go to one bucket and that together tile its end-to-end time. An interval's buckets
are the seconds of each segment that overlap it, so a window that cuts through a span, a step, a
recovery wait or a checkpoint save gets exactly its own share of each. This module parses the user's
times and intersects; it never reads events or decides which bucket a second belongs to.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime as dt
import math
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from warmstart.metrics.buckets import CHECKPOINT_BLOCKING, EFFECTIVE, LOST, RECOVERY, SHUTDOWN
from warmstart.metrics.calculator import (
    AttemptResult,
    AttemptTimeline,
    RankResult,
    RunResult,
    Segment,
    SpanMark,
    ordered_buckets,
)
from warmstart.metrics.window_results import FleetWindow, Window

MAX_WINDOWS = 10_000  # a longer series is a typo (--every 1s over a month), not a report
DEFAULT_WINDOWS = (20, 100)  # how many windows a chart gets when no length is asked for (default_every)
# Window lengths a default may pick, seconds: round to read, each at most 2.5 times the one before,
# so the first that fits makes at least 100 / 2.5 windows.
_ROUND_EVERY_S = (
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    10800,
    21600,
    43200,
    86400,
    172800,
    259200,
    604800,
    1209600,
    2419200,
)

TIME_FORMS = "epoch seconds (e.g. 1714564800) or an ISO-8601 time (e.g. 2024-05-01T12:00:00Z)"
DURATION_FORMS = "a positive duration such as 30s, 15m, 1h, 1d or 1h30m (a bare number is seconds)"
RANGE_FORMS = f"T1..T2, each T {TIME_FORMS}, T1 before T2"

_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhdw])")


# -- parsing -------------------------------------------------------------------------------------------


def parse_time(text: str) -> float:
    """A point in time as unix seconds: epoch seconds, or an ISO-8601 time (local time when it names
    no offset, like ``date`` and ``journalctl --since``).

    Raises:
        ValueError: neither form; the message says what is accepted.
    """
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return value
        raise ValueError(f"{text!r} is not a time: expected {TIME_FORMS}")
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: expected {TIME_FORMS}") from None
    return when.timestamp()


def parse_duration(text: str) -> float:
    """A duration in seconds: ``30s``, ``15m``, ``1h``, ``1d``, ``1w``, sums like ``1h30m``, or a bare
    number of seconds.

    Raises:
        ValueError: not a duration, or not above zero; the message says what is accepted.
    """
    text = text.strip().lower()
    seconds: float | None = None
    try:
        seconds = float(text)
    except ValueError:
        if text and _DURATION_PART.sub("", text) == "":
            seconds = sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(text))
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{text!r} is not a duration: expected {DURATION_FORMS}")
    return seconds


def parse_range(text: str) -> tuple[float, float]:
    """A range ``T1..T2`` of two times (see :func:`parse_time`), T1 before T2.

    Raises:
        ValueError: no ``..``, a side that is not a time, or T1 not before T2.
    """
    first, sep, second = text.partition("..")
    if not sep or not first.strip() or not second.strip():
        raise ValueError(f"{text!r} is not a range: expected {RANGE_FORMS}")
    try:
        start, end = parse_time(first), parse_time(second)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a range: {exc}") from None
    if start >= end:
        raise ValueError(f"{text!r} is an empty range: expected {RANGE_FORMS}")
    return start, end


def format_time(ts: float) -> str:
    """``ts`` as a local ISO-8601 time with its offset, to the second (the form :func:`parse_time` reads)."""
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def default_every(since: float, until: float, origin: float = 0.0) -> float:
    """A round window length (1s, 5m, 1h, 1d, 1w ...) that cuts ``[since, until)`` into
    :data:`DEFAULT_WINDOWS` windows lined up on ``origin`` as :class:`FleetWindows` lines them up: the
    shortest with at most 100. Spans under 20 s get 20 equal windows; spans over 100 x 4 weeks get
    multiples of 4 weeks.
    """
    fewest, most = DEFAULT_WINDOWS
    span = until - since
    if span <= 0:
        return float(_ROUND_EVERY_S[0])
    if span < fewest * _ROUND_EVERY_S[0]:
        return span / fewest

    def count(every: float) -> int:
        return math.ceil((until - origin) / every) - math.floor((since - origin) / every)

    for every in _ROUND_EVERY_S:
        if count(every) <= most:
            return float(every)
    longest = _ROUND_EVERY_S[-1]
    return float(longest * math.ceil(span / (longest * (most - 1))))


# -- what a report counts ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimeFilter:
    """Which time a report counts, and how it is sliced; times are unix seconds."""

    since: float | None = None
    """Count nothing before this (the job's start when None)."""
    until: float | None = None
    """Count nothing from this on (the job's end when None)."""
    exclude: tuple[tuple[float, float], ...] = ()
    """Ranges [start, end) left out of every total: in no bucket and not in end-to-end time."""
    every: float | None = None
    """Window length in seconds; None: no windows."""

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError(f"since ({format_time(self.since)}) must be before until ({format_time(self.until)})")
        if self.every is not None and not self.every > 0:
            raise ValueError(f"every={self.every!r}: expected a positive number of seconds")
        for start, end in self.exclude:
            if not start < end:
                raise ValueError(f"exclude ({start!r}, {end!r}): expected start before end")

    @property
    def restricts(self) -> bool:
        """Whether the total is narrower than the whole job."""
        return self.since is not None or self.until is not None or bool(self.exclude)

    def kept(self, start: float, end: float) -> list[tuple[float, float]]:
        """The parts of [start, end) that count: inside since/until, outside every excluded range."""
        lo = start if self.since is None else max(start, self.since)
        hi = end if self.until is None else min(end, self.until)
        pieces = [(lo, hi)] if hi > lo else []
        for x0, x1 in sorted(self.exclude):
            cut: list[tuple[float, float]] = []
            for a, b in pieces:
                if x1 <= a or x0 >= b:
                    cut.append((a, b))
                    continue
                if x0 > a:
                    cut.append((a, x0))
                if x1 < b:
                    cut.append((x1, b))
            pieces = cut
        return pieces


# -- one job -------------------------------------------------------------------------------------------


def apply(result: RunResult, time: TimeFilter) -> RunResult:
    """``result`` restricted to ``time`` (:func:`restrict`), with its windows when ``time.every`` is set."""
    windows = run_windows(result, time) if time.every is not None else None
    out = restrict(result, time) if time.restricts else dataclasses.replace(result)
    out.windows = windows
    return out


def restrict(result: RunResult, time: TimeFilter) -> RunResult:
    """The same report over the counted time only: buckets, end-to-end, ETT%, L1 figures, attempts and
    ranks as if the job's clock ran only inside ``time``'s interval and outside its excluded ranges.

    Failures count where their ``failure`` event lies in counted time. The attempts kept are those with
    counted time; their step counts stay the whole attempt's.

    Raises:
        ValueError: ``result`` was computed without segments.
    """
    _need_segments(result)
    lo = result.start_ts if time.since is None else max(result.start_ts, time.since)
    hi = result.end_ts if time.until is None else min(result.end_ts, time.until)
    hi = max(hi, lo)
    pieces = time.kept(result.start_ts, result.end_ts)

    segments = list(_clipped(result.segments, pieces))
    counted = _counted(segments)
    totals = _like(counted.buckets, result.buckets)
    e2e = sum(totals.values())
    # Attempts without counted time drop out; segments then point at the kept ones' new positions.
    kept = [i for i in range(len(result.attempts)) if sum(counted.per_attempt.get(i, {}).values()) > 0]
    index = {old: new for new, old in enumerate(kept)}
    attempts = [_restricted_attempt(result.attempts[i], counted, i, lo, hi) for i in kept]
    segments = [s._replace(attempt=index[s.attempt]) for s in segments]
    ranks, rank_segments = _restricted_ranks(result, segments, pieces, index)
    timeline = [tl for tl in (_clip_timeline(tl, lo, hi) for tl in result.timeline) if tl is not None]
    return dataclasses.replace(
        result,
        start_ts=lo,
        end_ts=hi,
        e2e_s=e2e,
        ett_pct=_pct(totals[EFFECTIVE], e2e),
        buckets=totals,
        l1=_restricted_l1(result, pieces, counted.init, totals),
        attempts=attempts,
        ranks=ranks,
        timeline=timeline,
        segments=segments,
        rank_segments=rank_segments,
        windows=None,
    )


class _Counted(NamedTuple):
    """The counted seconds of a job's segments, by bucket."""

    buckets: dict[str, float]
    per_attempt: dict[int, dict[str, float]]
    """By attempt (its index in the result's attempts), then bucket."""
    init: dict[int, float]
    """By attempt: the seconds before its first step."""


def _counted(segments: list[Segment]) -> _Counted:
    buckets: dict[str, float] = defaultdict(float)
    per_attempt: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    init: dict[int, float] = defaultdict(float)
    for seg in segments:
        seconds = (seg.end - seg.start) * seg.share
        buckets[seg.bucket] += seconds
        per_attempt[seg.attempt][seg.bucket] += seconds
        if seg.init:
            init[seg.attempt] += seconds
    return _Counted(buckets, per_attempt, init)


def _restricted_attempt(attempt: AttemptResult, counted: _Counted, index: int, lo: float, hi: float) -> AttemptResult:
    own = _like(counted.per_attempt[index], attempt.buckets)
    own_e2e = sum(own.values())
    return dataclasses.replace(
        attempt,
        start_ts=min(max(attempt.start_ts, lo), hi),
        end_ts=max(min(attempt.end_ts, hi), lo),
        e2e_s=own_e2e,
        ett_pct=100.0 * own[EFFECTIVE] / own_e2e,  # a kept attempt has counted time
        buckets=own,
        pre_first_step_s=counted.init[index],
        recovery_wait_s=own[RECOVERY],
    )


def _restricted_l1(
    result: RunResult, pieces: Sequence[tuple[float, float]], init: dict[int, float], totals: dict[str, float]
) -> dict[str, Any]:
    by_category: dict[str, int] = defaultdict(int)
    for a in result.attempts:
        if a.failed and a.failure and _holds(pieces, a.failure["ts"], result.end_ts):
            by_category[a.failure["category"]] += 1
    l1 = dict(result.l1)
    l1.update(
        {
            "time_to_start_s": init.get(0, 0.0),
            "time_to_recover_s": sum(s for i, s in init.items() if i > 0) + totals[RECOVERY],
            "failures": sum(by_category.values()),
            "failures_by_category": dict(sorted(by_category.items())),
            "lost_progress_s": totals[LOST],
            "checkpoint_blocking_s": totals[CHECKPOINT_BLOCKING],
            "shutdown_s": totals[SHUTDOWN],
        }
    )
    return l1


def _restricted_ranks(
    result: RunResult, segments: list[Segment], pieces: Sequence[tuple[float, float]], index: dict[int, int]
) -> tuple[dict[int, RankResult], dict[int, list[Segment]]]:
    """Each rank's breakdown over the counted time, and its clipped segments (``segments``: the job's)."""
    ranks: dict[int, RankResult] = {}
    rank_segments: dict[int, list[Segment]] = {}
    for rank, rank_own_segments in result.rank_segments.items():
        if rank_own_segments is result.segments:  # the primary rank: the job's own timeline
            clipped = segments
        else:
            clipped = [s._replace(attempt=index.get(s.attempt, -1)) for s in _clipped(rank_own_segments, pieces)]
        rank_segments[rank] = clipped
        whole = result.ranks.get(rank)
        rank_buckets = _like(_sum_buckets(clipped), whole.buckets if whole is not None else {})
        rank_e2e = sum(rank_buckets.values())
        ranks[rank] = RankResult(e2e_s=rank_e2e, ett_pct=_pct(rank_buckets[EFFECTIVE], rank_e2e), buckets=rank_buckets)
    return ranks, rank_segments


def run_windows(result: RunResult, time: TimeFilter) -> list[Window]:
    """Consecutive windows of ``time.every`` seconds from ``time.since`` (else the job's start) to
    ``time.until`` (else the job's end), the last one cut short there, each with the ETT% of its
    counted time.

    Raises:
        ValueError: ``time.every`` is unset, the series would exceed :data:`MAX_WINDOWS`, or ``result``
            was computed without segments.
    """
    if time.every is None:
        raise ValueError("run_windows needs a TimeFilter with every set")
    if not result.attempts:
        return []
    _need_segments(result)
    origin = result.start_ts if time.since is None else time.since
    end = result.end_ts if time.until is None else time.until
    count = _window_count(origin, end, time.every)
    ends = [s.end for s in result.segments]
    windows = []
    for k in range(count):
        since = origin + k * time.every
        until = min(origin + (k + 1) * time.every, end)
        pieces = time.kept(max(since, result.start_ts), min(until, result.end_ts))
        buckets = _like(_sum_buckets(_overlapping(result.segments, ends, pieces)), result.buckets)
        e2e = sum(buckets.values())
        windows.append(
            Window(
                since=since,
                until=until,
                e2e_s=e2e,
                ett_pct=_pct(buckets[EFFECTIVE], e2e),
                buckets=buckets,
                failures=_failures(result, pieces),
            )
        )
    return windows


# -- a fleet -------------------------------------------------------------------------------------------


class FleetWindows:
    """Fleet ETT% per window, folded one job at a time like :class:`~warmstart.metrics.fleet.FleetResult`.

    Windows line up across jobs: they start at ``time.since``, else at a multiple of ``time.every``
    since the unix epoch (``1h`` windows start on the hour, UTC), and cover every job's counted time.
    """

    def __init__(self, time: TimeFilter) -> None:
        if time.every is None:
            raise ValueError("FleetWindows needs a TimeFilter with every set")
        self.time = time
        self._every = time.every
        self._origin = 0.0 if time.since is None else time.since
        self._rows: dict[int, dict[str, Any]] = {}
        self._span: tuple[int, int] | None = None  # first and last window index any job reached
        self._names: dict[str, float] = {}  # every bucket any job has, so that all windows list the same

    def add(self, result: RunResult) -> None:
        """Fold one job in (weighted by its devices); a job without counted time adds nothing.

        Raises:
            ValueError: the job would stretch the series past :data:`MAX_WINDOWS`, or ``result`` was
                computed without segments.
        """
        if not result.attempts:
            return
        _need_segments(result)
        lo = result.start_ts if self.time.since is None else max(result.start_ts, self.time.since)
        hi = result.end_ts if self.time.until is None else min(result.end_ts, self.time.until)
        if hi <= lo:
            return
        first = math.floor((lo - self._origin) / self._every)
        last = math.ceil((hi - self._origin) / self._every)
        self._check_span(first, last)
        self._names.update(dict.fromkeys(result.buckets, 0.0))
        ends = [s.end for s in result.segments]
        for k in range(first, last):
            since, until = self._bounds(k)
            pieces = self.time.kept(max(since, result.start_ts), min(until, result.end_ts))
            buckets = _sum_buckets(_overlapping(result.segments, ends, pieces))
            e2e = sum(buckets.values())
            if e2e <= 0:
                continue
            row = self._rows.setdefault(k, {"jobs": 0, "failures": 0, "buckets": defaultdict(float)})
            row["jobs"] += 1
            row["failures"] += _failures(result, pieces)
            for name, seconds in buckets.items():
                row["buckets"][name] += seconds * result.devices

    def windows(self) -> list[FleetWindow]:
        """The series, with no gaps: windows that no job reaches have ``jobs`` 0 and ``ett_pct`` None."""
        if not self._rows:
            return []
        first = 0 if self.time.since is not None else min(self._rows)
        last = max(self._rows) + 1
        if self.time.until is not None:
            last = max(last, math.ceil((self.time.until - self._origin) / self._every))
        self._check_span(first, last)
        out = []
        for k in range(first, last):
            since, until = self._bounds(k)
            row = self._rows.get(k, {"jobs": 0, "failures": 0, "buckets": {}})
            buckets = _like(row["buckets"], self._names)
            total = sum(buckets.values())
            out.append(
                FleetWindow(
                    since=since,
                    until=until,
                    jobs=row["jobs"],
                    device_seconds=total,
                    effective_device_seconds=buckets[EFFECTIVE],
                    ett_pct=_pct(buckets[EFFECTIVE], total),
                    buckets=buckets,
                    failures=row["failures"],
                )
            )
        return out

    def _bounds(self, k: int) -> tuple[float, float]:
        since = self._origin + k * self._every
        until = self._origin + (k + 1) * self._every
        return since, until if self.time.until is None else min(until, self.time.until)

    def _check_span(self, first: int, last: int) -> None:
        lo, hi = (first, last - 1) if self._span is None else (min(self._span[0], first), max(self._span[1], last - 1))
        _check_count(hi - lo + 1, self._every)
        self._span = (lo, hi)


# -- helpers -------------------------------------------------------------------------------------------


def _need_segments(result: RunResult) -> None:
    if result.e2e_s > 0 and not result.segments:
        raise ValueError(f"{result.job}: computed without segments; use compute(run, segments=True)")


def _like(buckets: dict[str, float], like: dict[str, float]) -> dict[str, float]:
    """``buckets`` in report order with at least ``like``'s names (0 when absent), so that a restricted
    total and every window of a series list the same buckets as the whole job."""
    return ordered_buckets({**dict.fromkeys(like, 0.0), **buckets})


def _window_count(origin: float, end: float, every: float) -> int:
    count = max(0, math.ceil((end - origin) / every))
    _check_count(count, every)
    return count


def _check_count(count: int, every: float) -> None:
    if count > MAX_WINDOWS:
        raise ValueError(
            f"windows of {every:g} s make {count:,} windows here, more than {MAX_WINDOWS:,}: expected a longer duration"
        )


def _overlapping(
    segments: Sequence[Segment], ends: Sequence[float], pieces: Sequence[tuple[float, float]]
) -> Iterator[Segment]:
    """The parts of ``segments`` (sorted, with ``ends`` their end times) inside each of ``pieces``."""
    for a, b in pieces:
        # Segments follow each other in time (those sharing an instant have equal bounds), so their
        # ends are sorted too: skip straight to the first that ends after ``a``.
        i = bisect.bisect_right(ends, a)
        while i < len(segments) and segments[i].start < b:
            seg = segments[i]
            start, end = max(seg.start, a), min(seg.end, b)
            if end > start:
                yield seg._replace(start=start, end=end)
            i += 1


def _clipped(segments: Sequence[Segment], pieces: Sequence[tuple[float, float]]) -> Iterator[Segment]:
    return _overlapping(segments, [s.end for s in segments], pieces)


def _sum_buckets(segments: Iterator[Segment] | Sequence[Segment]) -> dict[str, float]:
    buckets: dict[str, float] = defaultdict(float)
    for seg in segments:
        buckets[seg.bucket] += (seg.end - seg.start) * seg.share
    return buckets


def _holds(pieces: Sequence[tuple[float, float]], ts: float, job_end: float) -> bool:
    # Half-open pieces, except that the job's last instant (a failure that ends the job) counts in the
    # piece that ends there.
    return any(a <= ts < b or ts == b == job_end for a, b in pieces)


def _failures(result: RunResult, pieces: Sequence[tuple[float, float]]) -> int:
    return sum(1 for a in result.attempts if a.failed and a.failure and _holds(pieces, a.failure["ts"], result.end_ts))


def _clip_timeline(tl: AttemptTimeline, lo: float, hi: float) -> AttemptTimeline | None:
    """The part of one attempt's chart inside [lo, hi]; None when nothing of it is."""
    before = _clip_pair(tl.recovery_before, lo, hi)
    after = _clip_pair(tl.recovery_after, lo, hi)
    start, end = max(tl.start, lo), min(tl.end, hi)
    if end <= start and before is None and after is None:
        return None
    if end < start:  # only its recovery wait is counted: an empty lane with that wait
        start = end = before[1] if before else after[0]  # type: ignore[index]

    def inside(ts: float | None) -> float | None:
        return None if ts is None else min(max(ts, start), end)

    first_step = inside(tl.first_step) if tl.first_step is not None and tl.first_step < end else None
    train_end = tl.train_end if tl.train_end is not None and tl.train_end < end else None
    failure = tl.failure if tl.failure and lo <= tl.failure["ts"] <= hi else None
    spans = [
        SpanMark(s.name, s.bucket, max(s.start, start), min(s.end, end), s.rank)
        for s in tl.spans
        if min(s.end, end) > max(s.start, start)
    ]
    return dataclasses.replace(
        tl,
        start=start,
        end=end,
        first_step=first_step,
        loop_end=inside(tl.loop_end) if first_step is not None else None,
        train_end=inside(train_end),
        lost_from=inside(tl.lost_from),
        failure=failure,
        spans=spans,
        steps=[p for p in tl.steps if lo <= p[0] <= hi],
        checkpoints=[p for p in tl.checkpoints if lo <= p[0] <= hi],
        recovery_before=before,
        recovery_after=after,
    )


def _clip_pair(pair: tuple[float, float] | None, lo: float, hi: float) -> tuple[float, float] | None:
    if pair is None:
        return None
    a, b = max(pair[0], lo), min(pair[1], hi)
    return (a, b) if b > a else None


def _pct(part: float, whole: float) -> float | None:
    # A total, attempt or rank without counted time has no ETT%, as a window without any has none.
    return 100.0 * part / whole if whole > 0 else None
