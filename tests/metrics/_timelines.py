"""Helpers to write hand-made event timelines (times relative to a fixed epoch) for the metrics tests."""

from __future__ import annotations

from pathlib import Path

from warmstart.metrics.calculator import RunResult, compute, load_runs
from warmstart.metrics.events import write_events

T0 = 1_700_000_000.0


def ev(t: float, event: str, attempt: int = 0, rank: int = 0, job: str = "job-1", **fields) -> dict:
    """One event ``t`` seconds after the epoch of the test timelines."""
    return {"ts": T0 + t, "job": job, "attempt": attempt, "rank": rank, "event": event, **fields}


def span(start: float, end: float, name: str, attempt: int = 0, rank: int = 0, **fields) -> list[dict]:
    """A begin/end pair."""
    return [ev(start, "begin", attempt, rank, span=name, **fields), ev(end, "end", attempt, rank, span=name, **fields)]


def run_of(run_dir: Path, *files: list[dict]) -> RunResult:
    """Write each list of events to its own file in ``run_dir`` and compute the single run found."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for i, events in enumerate(files):
        write_events(run_dir / f"events-{i}.jsonl", events)
    runs = load_runs([run_dir])
    assert len(runs) == 1
    return compute(runs[0])


def nonzero(buckets: dict[str, float]) -> dict[str, float]:
    """The buckets that hold time, rounded to microseconds (the epoch costs float precision)."""
    return {name: round(seconds, 6) for name, seconds in buckets.items() if abs(seconds) > 1e-9}
