"""ETT% metrics: record events (``Recorder``), compute the buckets of docs/reference.md#events (``load_runs``,
``compute``), and report them (``warmstart.metrics.report``).

The recorder side is imported eagerly (the start-up hook needs it); the calculator only when used,
so a training process never pays for it.

Example:
    >>> from warmstart.metrics import get_recorder
    >>> rec = get_recorder()          # no-op unless WARMSTART_RUN_DIR or WARMSTART=1 is set
    >>> with rec.span("sharding_plan"):
    ...     pass
    >>> rec.step(0)
"""

from typing import Any

from warmstart.metrics.auto import install_compile_spans
from warmstart.metrics.cache_spans import CacheSpans
from warmstart.metrics.events import Event, EventFormatError, TornLineWarning, read_events, write_events
from warmstart.metrics.recorder import NullRecorder, Recorder, get_recorder, reset_process_recorder

_CALCULATOR = ("RunResult", "compute", "compute_runs", "load_runs")

__all__ = [
    "Event",
    "EventFormatError",
    "TornLineWarning",
    "read_events",
    "write_events",
    *_CALCULATOR,
    "Recorder",
    "NullRecorder",
    "get_recorder",
    "reset_process_recorder",
    "install_compile_spans",
    "CacheSpans",
]


def __getattr__(name: str) -> Any:
    if name in _CALCULATOR:
        from warmstart.metrics import calculator

        return getattr(calculator, name)
    raise AttributeError(f"module 'warmstart.metrics' has no attribute {name!r}")
