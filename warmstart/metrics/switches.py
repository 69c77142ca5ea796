"""Background compiles in a job's events: when each rank switched from eager to compiled, and its step
time before and after (docs/metrics.md#background-compiles).

With ``WARMSTART_COMPILE=background`` a rank trains eagerly while a worker compiles; those steps are
training like any other (they consume new data). Each function or module that switches writes a
``compile_switch`` span of no length on its rank. Pure: events in, one :class:`CompileSwitch` per
attempt and rank out; it moves no second between buckets.

* A step runs from its ``step`` event to the same rank's next one in the same attempt.
* Eager steps are those that ended before the rank's first switch, compiled steps those that started
  after its last one (a model compiled region by region switches once per region); the steps the
  switches fell in are neither.
* Step times are medians: the first eager step also runs the eager warm-up, the first compiled one the
  install, and neither should stand for the rest.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, NamedTuple

from warmstart.metrics.buckets import COMPILE_SWITCH
from warmstart.metrics.events import AttemptStart, Begin, Event, Step


@dataclasses.dataclass(frozen=True)
class CompileSwitch:
    """Where one rank of one attempt went from eager to compiled."""

    attempt: int
    rank: int
    ts: float
    """Unix time of the rank's first switch."""
    at_s: float
    """Seconds from the attempt's start (its ``attempt_start``, else the rank's first event) to the
    rank's first switch."""
    last_at_s: float
    """The same for its last switch (equal to ``at_s`` when one function or module switched)."""
    switches: int
    """How many switches this rank made: one per function or module, and one per recompile a worker
    compiled for it."""
    during_step: int | None
    """The step that was running at the first switch; ``None`` before the first step."""
    eager_steps: int
    eager_step_s: float | None
    """Median duration of the steps that ended before the first switch; ``None`` when none did."""
    compiled_steps: int
    compiled_step_s: float | None
    """Median duration of the steps that started after the last switch and ended before the next step
    event (the attempt's last step has no end and is not timed)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compile_switches(events: Iterable[Event]) -> list[CompileSwitch]:
    """One :class:`CompileSwitch` per attempt and rank that switched, by attempt then rank."""
    events = events if isinstance(events, list) else list(events)
    switches = _switch_times(events)
    if not switches:  # a job without background compiles (most): one pass, nothing kept
        return []
    seen = _what_switching_ranks_saw(events, switches)
    return [
        _compile_switch(
            where,
            times,
            origin=seen.attempt_starts.get(where[0], seen.first_event[where]),
            steps=sorted(seen.steps.get(where, [])),
        )
        for where, times in sorted(switches.items())
    ]


def _switch_times(events: list[Event]) -> dict[tuple[int, int], list[float]]:
    """The times of each (attempt, rank)'s ``compile_switch`` spans."""
    switches: dict[tuple[int, int], list[float]] = defaultdict(list)
    for ev in events:
        if isinstance(ev, Begin) and ev.span == COMPILE_SWITCH:
            switches[(ev.attempt, ev.rank)].append(ev.ts)
    return switches


class _Seen(NamedTuple):
    """What a switch is placed against: where its attempt started and its rank's steps."""

    attempt_starts: dict[int, float]
    """Per attempt, its first ``attempt_start`` on any rank."""
    first_event: dict[tuple[int, int], float]
    """Per switching (attempt, rank), its first event."""
    steps: dict[tuple[int, int], list[tuple[float, int]]]
    """Per switching (attempt, rank), its steps as (time, step number)."""


def _what_switching_ranks_saw(events: list[Event], switches: dict[tuple[int, int], list[float]]) -> _Seen:
    seen = _Seen({}, {}, defaultdict(list))
    for ev in events:
        where = (ev.attempt, ev.rank)
        if isinstance(ev, AttemptStart):
            seen.attempt_starts[ev.attempt] = min(seen.attempt_starts.get(ev.attempt, ev.ts), ev.ts)
        if where not in switches:
            continue
        seen.first_event[where] = min(seen.first_event.get(where, ev.ts), ev.ts)
        if isinstance(ev, Step):
            seen.steps[where].append((ev.ts, ev.step))
    return seen


def _compile_switch(
    where: tuple[int, int], times: list[float], *, origin: float, steps: list[tuple[float, int]]
) -> CompileSwitch:
    """One rank's switch, from its switch times and its steps in time order."""
    first, last = min(times), max(times)
    timed = [(start, end) for (start, _), (end, _) in zip(steps, steps[1:], strict=False)]
    during = [step for start, step in steps if start <= first]
    eager = [end - start for start, end in timed if end <= first]
    compiled = [end - start for start, end in timed if start >= last]
    attempt, rank = where
    return CompileSwitch(
        attempt=attempt,
        rank=rank,
        ts=first,
        at_s=first - origin,
        last_at_s=last - origin,
        switches=len(times),
        during_step=during[-1] if during else None,
        eager_steps=len(eager),
        eager_step_s=statistics.median(eager) if eager else None,
        compiled_steps=len(compiled),
        compiled_step_s=statistics.median(compiled) if compiled else None,
    )
