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
from typing import Any

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
    marks: dict[tuple[int, int], list[float]] = defaultdict(list)
    for ev in events:
        if isinstance(ev, Begin) and ev.span == COMPILE_SWITCH:
            marks[(ev.attempt, ev.rank)].append(ev.ts)
    if not marks:  # a job without background compiles (most): one pass, nothing kept
        return []
    starts: dict[int, float] = {}
    first_event: dict[tuple[int, int], float] = {}
    steps: dict[tuple[int, int], list[tuple[float, int]]] = defaultdict(list)
    for ev in events:
        where = (ev.attempt, ev.rank)
        if isinstance(ev, AttemptStart):
            starts[ev.attempt] = min(starts.get(ev.attempt, ev.ts), ev.ts)
        if where not in marks:
            continue
        first_event[where] = min(first_event.get(where, ev.ts), ev.ts)
        if isinstance(ev, Step):
            steps[where].append((ev.ts, ev.step))
    found = []
    for (attempt, rank), times in sorted(marks.items()):
        first, last = min(times), max(times)
        origin = starts.get(attempt, first_event[(attempt, rank)])
        ordered = sorted(steps.get((attempt, rank), []))
        timed = [(b, e, n) for (b, n), (e, _) in zip(ordered, ordered[1:], strict=False)]
        during = [n for b, n in ordered if b <= first]
        eager = [e - b for b, e, _ in timed if e <= first]
        compiled = [e - b for b, e, _ in timed if b >= last]
        found.append(
            CompileSwitch(
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
        )
    return found
