"""ETT% metrics: record events (``Recorder``), compute the buckets of docs/reference.md#events (``load_runs``,
``compute``), and report them (``warmstart.metrics.report``; the HTML page, ``warmstart.metrics.report_html``).

The recorder side is imported eagerly (the start-up hook needs it); the calculator only when used,
so a training process never pays for it.

Example:
    >>> from warmstart.metrics import get_recorder
    >>> rec = get_recorder()          # no-op unless WARMSTART_RUN_DIR or WARMSTART=1 is set
    >>> with rec.span("sharding_plan"):
    ...     pass
    >>> rec.step(0)
"""

from collections.abc import Callable
from typing import Any

from warmstart.metrics.auto import install_compile_spans
from warmstart.metrics.cache_spans import CacheSpans
from warmstart.metrics.events import Event, EventFormatError, TornLineWarning, read_events, write_events
from warmstart.metrics.recorder import (
    NullRecorder,
    Recorder,
    get_recorder,
    on_process_recorder,
    reset_process_recorder,
)

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


def _start_live_metrics(rec: Recorder) -> Callable[[bool], None] | None:
    # Here, not in the recorder: the live metrics are a layer above it. Imported (prometheus_client
    # with it) only once a process recorder exists; the exporter decides from the settings.
    from warmstart.metrics.live import start_exporter

    exporter = start_exporter(rec)
    if exporter is None:
        return None
    return lambda at_exit: exporter.stop(at_exit=at_exit)


on_process_recorder(_start_live_metrics)


def __getattr__(name: str) -> Any:
    if name in _CALCULATOR:
        from warmstart.metrics import calculator

        return getattr(calculator, name)
    raise AttributeError(f"module 'warmstart.metrics' has no attribute {name!r}")
