"""ETT% metrics: record events (``Recorder``), compute the buckets of CONTRACT §4 (``load_runs``,
``compute``), and report them (``warmstart.metrics.report``).

Example:
    >>> from warmstart.metrics import get_recorder
    >>> rec = get_recorder()          # no-op unless WARMSTART_RUN_DIR or WARMSTART=1 is set
    >>> with rec.span("sharding_plan"):
    ...     pass
    >>> rec.step(0)
"""

from warmstart.metrics.auto import install_compile_spans
from warmstart.metrics.calculator import RunResult, compute, compute_runs, load_runs
from warmstart.metrics.events import Event, EventFormatError, TornLineWarning, read_events, write_events
from warmstart.metrics.recorder import NullRecorder, Recorder, get_recorder, reset_process_recorder

__all__ = [
    "Event", "EventFormatError", "TornLineWarning", "read_events", "write_events",
    "load_runs", "compute", "compute_runs", "RunResult",
    "Recorder", "NullRecorder", "get_recorder", "reset_process_recorder", "install_compile_spans",
]
