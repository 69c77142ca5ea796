"""Live ETT and cache metrics in the Prometheus format while a job runs (docs/metrics.md#live-metrics).

This module owns one process's exporter: a background thread that, every interval, reads the lines
appended to the job's event files since its last look (rank 0's and the job-level ones, which define
the job's timeline, and this rank's own, which do where rank 0's files are elsewhere), recomputes the
job's figures with the calculator, so that they are the ones ``warmstart ett report`` would give if
the job's attempt ended at that moment, and keeps them for prometheus_client to expose: at each scrape of
the HTTP endpoint (``start_http_server``) and in a textfile for node_exporter, rewritten atomically
(``write_to_textfile``). It never touches the recorder's hot path and never raises into the job: a
delivery that fails (a port taken, an unwritable file) is turned off with one warning line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from warmstart import _defaults
from warmstart.config import MetricsSettings, metrics_settings
from warmstart.errors import ConfigError
from warmstart.metrics.buckets import EFFECTIVE
from warmstart.metrics.event_files import LineTail, event_files, rank_attempt
from warmstart.metrics.events import FAILURE_CATEGORIES, Event, parse_event

if TYPE_CHECKING:
    from warmstart.metrics.recorder import Recorder

log = logging.getLogger(__name__)

_DECODER = msgspec.json.Decoder(Event)
_LABELS = ["job_id", "rank"]

_exporters: weakref.WeakSet[Exporter] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The job's figures at one refresh: what scrapes and the textfile show until the next one."""

    ett_pct: float
    recent_ett_pct: float | None
    """ETT% over the last ``METRICS_WINDOW_S`` of the job's time; ``None`` until that is known."""
    e2e_s: float
    buckets: dict[str, float]
    devices: int
    failures: dict[str, int]
    """Failures by category, every category of the event format present (0 when none)."""
    attempts: int
    steps: int
    last_committed_step: int | None


class Exporter:
    """Exposes the live metrics of the job ``recorder`` records (docs/metrics.md#live-metrics).

    Example:
        >>> exporter = Exporter(rec, MetricsSettings(port=9400, interval_s=5))
        >>> exporter.start()   # serves :9400/metrics; a thread refreshes every 5 s
        >>> exporter.stop()

    Args:
        recorder: the process's recorder; its run directory, job and rank say what to export, and it
            is flushed before each look, so the figures include what it buffered.
        settings: where the metrics go; the port and textfile name are this process's own (see
            :func:`start_exporter`).
        clock: the present, unix seconds: the job's open attempt runs until then.
    """

    def __init__(self, recorder: Recorder, settings: MetricsSettings, clock: Callable[[], float] = time.time) -> None:
        from prometheus_client import CollectorRegistry

        self.recorder = recorder
        self.settings = settings
        self.port, self.textfile = settings.port, settings.textfile
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self.snapshot: Snapshot | None = None
        self._clock = clock
        self._labels = [recorder.job, str(recorder.rank)]
        self._tail = _EventTail(Path(recorder.run_dir), recorder.job, recorder.rank)
        self._history: deque[tuple[float, float]] = deque()  # (e2e_s, effective_s) at each refresh
        self._cache_seen: dict[tuple[str, str, str], float] = {}
        self._costs: deque[float] = deque(maxlen=3)  # thread CPU seconds of the latest refreshes
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._httpd: Any = None
        self._pid = os.getpid()
        self._warned: set[str] = set()

    def start(self) -> None:
        """Open the HTTP endpoint and start the refresh thread. A port that cannot be bound turns the
        endpoint off with one warning; nothing here raises over it."""
        if self.port is not None:
            from prometheus_client import start_http_server

            try:
                self._httpd, _ = start_http_server(self.port, registry=self.registry)
            except OSError as exc:
                self._off(f"cannot serve them on port {self.port} ({exc.strerror or exc})")
                self.port = None
        if self._httpd is None and self.textfile is None:
            return
        _exporters.add(self)
        self._thread = threading.Thread(target=self._run, name="warmstart-metrics", daemon=True)
        self._thread.start()

    def refresh(self) -> Snapshot | None:
        """Read the job's new events and recompute its figures; returns them (``None`` before any event)."""
        from warmstart.metrics.calculator import Run, compute

        with self._refresh_lock:
            self.recorder.flush()
            events = self._tail.read()
            if not events:
                return self.snapshot
            # Recomputed even when nothing was written since the last look: the job's clock runs on
            # through a long compile or eval (to the present, which the calculator cannot know).
            result = compute(
                Run(job=self.recorder.job, run_dir=str(self._tail.run_dir), events=events), now=self._clock()
            )
            failures = {category: 0 for category in FAILURE_CATEGORIES}
            failures.update(result.l1["failures_by_category"])
            committed = [a.last_committed_step for a in result.attempts if a.last_committed_step is not None]
            effective = result.buckets[EFFECTIVE]
            assert result.ett_pct is not None  # only a window restricted to no counted time lacks one
            self.snapshot = Snapshot(
                ett_pct=result.ett_pct,
                recent_ett_pct=self._recent(result.e2e_s, effective),
                e2e_s=result.e2e_s,
                buckets=dict(result.buckets),
                devices=max(result.devices, len(self._tail.ranks)),
                failures=failures,
                attempts=len(result.attempts),
                steps=sum(a.steps for a in result.attempts),
                last_committed_step=committed[-1] if committed else None,
            )
            return self.snapshot

    def stop(self, *, at_exit: bool = False) -> None:
        """Stop the thread, write the textfile once more (the figures at exit) and close the endpoint.
        Safe to call twice; a no-op in a forked child, whose exporter is its parent's.

        Args:
            at_exit: the process is exiting: leave the endpoint to the exit, which closes its port at
                once (a clean shutdown waits up to half a second for the server's loop).
        """
        if os.getpid() != self._pid:
            return
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        if self.textfile is not None and thread is not None:
            self._refresh_quietly()
            self._write_textfile()
        httpd, self._httpd = self._httpd, None
        if httpd is not None and not at_exit:
            httpd.shutdown()
            httpd.server_close()
        _exporters.discard(self)

    # -- internals ---------------------------------------------------------------------------------

    def _run(self) -> None:
        first = True
        while True:
            cpu = time.thread_time()
            self._refresh_quietly()
            self._write_textfile()
            if not first:  # the first refresh also imports the calculator: no measure of a refresh
                self._costs.append(time.thread_time() - cpu)
            first = False
            if self._stop.wait(self.pause_s()):
                return

    def pause_s(self) -> float:
        """Seconds until the next refresh: the interval, or longer for a long job, whose many events
        cost more to recompute, so that refreshes never take more than a small share of a core from
        training. The cheapest of the latest refreshes sets it: one slowed by a pause of the machine
        must not leave the figures standing for many intervals."""
        cost = min(self._costs) if self._costs else 0.0
        return max(self.settings.interval_s, cost / _defaults.METRICS_MAX_CPU_SHARE)

    def _refresh_quietly(self) -> None:
        try:
            self.refresh()
        except Exception as exc:  # a malformed line from another writer: keep the last figures
            self._warn_once("refresh", "warmstart: live ETT figures not updated (%s: %s)", type(exc).__name__, exc)

    def _recent(self, e2e_s: float, effective_s: float) -> float | None:
        """ETT% over the last window of job time, from the figures of earlier refreshes."""
        window = _defaults.METRICS_WINDOW_S
        history = self._history
        if not history and e2e_s <= window:
            history.append((0.0, 0.0))  # the whole job so far lies inside the window
        history.append((e2e_s, effective_s))
        while len(history) > 2 and history[1][0] <= e2e_s - window:
            history.popleft()
        start_e2e, start_effective = history[0]
        if start_e2e > max(0.0, e2e_s - window) or e2e_s <= start_e2e:
            return None  # this process has not watched a whole window yet
        # A failure turns earlier effective time into lost progress: the window's share can dip below 0.
        return min(100.0, max(0.0, 100.0 * (effective_s - start_effective) / (e2e_s - start_e2e)))

    def _cache_counts(self) -> list[tuple[str, str, str, float]]:
        """(metric, tier, kind, count) of the process-wide compile cache; never lower than shown before."""
        self._read_cache_counts()
        return [(metric, tier, kind, value) for (metric, tier, kind), value in sorted(self._cache_seen.items())]

    def _read_cache_counts(self) -> None:
        if os.getpid() != self._pid:
            return
        cache = sys.modules.get("warmstart.compile_cache")  # a process that never imported the cache has none
        store = cache.get_store() if cache is not None else None
        if store is None:
            return
        # totals(): a store hands its counts to the shared stats file at exit, before the last
        # textfile is written, and they must still be there.
        for (tier, kind), counts in store.stats.totals():
            for metric, value in (("hits", counts.hits), ("misses", counts.misses)):
                key = (metric, tier, kind)  # a counter never goes down, whatever the store's reset
                self._cache_seen[key] = max(self._cache_seen.get(key, 0), value)

    def _write_textfile(self) -> None:
        path = self.textfile
        if path is None:
            return
        from prometheus_client import write_to_textfile

        try:
            write_to_textfile(str(path), self.registry)  # a temporary file renamed over the old one
        except OSError as exc:
            self.textfile = None
            self._off(f"cannot write {path} ({exc.strerror or exc})")

    def _off(self, why: str) -> None:
        log.warning("warmstart: live metrics off: %s; the job goes on", why)

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _after_fork_in_child(self) -> None:
        # A forked child (a data loader worker) must not keep the parent's port open after it exits.
        if self._httpd is not None:
            self._httpd.socket.close()


class _Collector:
    """prometheus_client's collector protocol over an exporter's last snapshot and live cache counts."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = weakref.ref(exporter)  # the registry must not keep a stopped exporter alive

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        exporter = self._exporter()
        if exporter is None:
            return
        labels, snap = exporter._labels, exporter.snapshot
        if snap is not None:

            def one(family: Any, value: float) -> Any:
                family.add_metric(labels, value)
                return family

            yield one(
                GaugeMetricFamily(
                    "warmstart_ett_percent",
                    "ETT%: effective training time over end-to-end time, as warmstart ett report computes it",
                    labels=_LABELS,
                ),
                snap.ett_pct,
            )
            if snap.recent_ett_pct is not None:
                yield one(
                    GaugeMetricFamily(
                        "warmstart_ett_recent_percent",
                        f"ETT% over the last {_defaults.METRICS_WINDOW_S:g} s of the job's time",
                        labels=_LABELS,
                    ),
                    snap.recent_ett_pct,
                )
            yield one(
                GaugeMetricFamily(
                    "warmstart_ett_e2e_seconds",
                    "End-to-end seconds, from the job's first attempt_start to its last event",
                    labels=_LABELS,
                ),
                snap.e2e_s,
            )
            buckets = GaugeMetricFamily(
                "warmstart_ett_bucket_seconds",
                "Seconds of end-to-end time per bucket (they sum to warmstart_ett_e2e_seconds)",
                labels=[*_LABELS, "bucket"],
            )
            for name, seconds in snap.buckets.items():
                buckets.add_metric([*labels, name], seconds)
            yield buckets
            yield one(
                GaugeMetricFamily(
                    "warmstart_ett_devices",
                    "Devices of the job: the most any attempt_start declared (1 when none did)",
                    labels=_LABELS,
                ),
                snap.devices,
            )
            failures = CounterMetricFamily(
                "warmstart_ett_failures", "Failed attempts by category", labels=[*_LABELS, "category"]
            )
            for category, count in snap.failures.items():
                failures.add_metric([*labels, category], count)
            yield failures
            yield one(CounterMetricFamily("warmstart_ett_attempts", "Attempts started", labels=_LABELS), snap.attempts)
            yield one(
                CounterMetricFamily("warmstart_ett_steps", "Training steps started, all attempts", labels=_LABELS),
                snap.steps,
            )
            if snap.last_committed_step is not None:
                yield one(
                    GaugeMetricFamily(
                        "warmstart_ett_last_committed_step", "Step of the last durable checkpoint", labels=_LABELS
                    ),
                    snap.last_committed_step,
                )
        counts = exporter._cache_counts()
        if counts:
            families = {
                metric: CounterMetricFamily(
                    f"warmstart_cache_{metric}",
                    f"Compile-cache {metric} of this process by tier and artifact kind",
                    labels=[*_LABELS, "tier", "kind"],
                )
                for metric in ("hits", "misses")
            }
            for metric, tier, kind, value in counts:
                families[metric].add_metric([*labels, tier, kind], value)
            yield from families.values()


class _EventTail:
    """One job's events in a run directory, read incrementally: each file from where the last look
    stopped, whole lines only (a line being written is read at the next look). Of the recorder's
    per-rank files, only those of ranks -1, 0 and ``rank`` are read."""

    def __init__(self, run_dir: Path, job: str, rank: int) -> None:
        self.run_dir, self.job, self._ranks = run_dir, job, {-1, 0, rank}
        self._files: dict[Path, tuple[LineTail, list[Event]]] = {}
        self.ranks: set[int] = set()
        """Every rank >= 0 with a recorder file here, read or not: the job's devices are at least as many."""

    def read(self) -> list[Event]:
        """Every event of the job read so far, the new ones included."""
        if not self.run_dir.is_dir():
            return []
        for path in event_files(self.run_dir):
            recorded = rank_attempt(path)
            if recorded is not None and recorded[0] >= 0:
                self.ranks.add(recorded[0])
            if recorded is not None and recorded[0] not in self._ranks:
                continue  # another rank's file refines its own breakdown, never the job's figures
            tail, events = self._files.get(path) or (LineTail(path), [])
            try:
                data, afresh = tail.read()
            except OSError:
                continue
            if afresh:  # replaced or truncated: what was read of it is gone
                events = []
            if data:
                events.extend(ev for ev in _decode(data) if ev.job == self.job)
            self._files[path] = (tail, events)
        return [ev for _, events in self._files.values() for ev in events]


def _decode(data: bytes) -> list[Event]:
    """The events of whole lines; a line that is no valid event (a torn write) is skipped, as the
    report skips it, but silently: the report names it."""
    try:
        return _DECODER.decode_lines(data)
    except msgspec.DecodeError:
        pass
    events = []
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            events.append(_DECODER.decode(raw))
            continue
        except msgspec.DecodeError:
            pass
        with contextlib.suppress(ValueError):
            events.append(parse_event(json.loads(raw)))  # an integer written as 3.0, as the report accepts
    return events


def process_outputs(settings: MetricsSettings) -> tuple[int | None, Path | None]:
    """This process's port and textfile: with every rank exporting, the port plus the local rank and,
    past local rank 0, ``NAME-<local rank>.prom``, so that the ranks of one machine never collide."""
    if not settings.all_ranks or settings.local_rank == 0:
        return settings.port, settings.textfile
    port = settings.port + settings.local_rank if settings.port is not None else None
    textfile = settings.textfile
    if textfile is not None:
        textfile = textfile.with_name(f"{textfile.stem}-{settings.local_rank}{textfile.suffix}")
    return port, textfile


def start_exporter(recorder: Recorder, settings: MetricsSettings | None = None) -> Exporter | None:
    """Start exporting the live metrics of ``recorder``'s job, when the settings ask for it in this rank.

    Rank 0 exports (every rank >= 0 with ``WARMSTART_METRICS_RANKS=all``). Never raises: a bad
    setting or a delivery that cannot start is one warning line, and the job goes on without it.

    Args:
        recorder: a recorder built by hand (the process-wide one, ``get_recorder()``'s, gets its
            exporter when it is built).
        settings: default: from the environment (``WARMSTART_METRICS_*``).

    Returns:
        The running exporter, or ``None`` when nothing is exported.
    """
    try:
        settings = settings or metrics_settings()
    except ConfigError as exc:
        log.warning("warmstart: live metrics off: %s", exc)
        return None
    if not settings.on or not recorder.enabled or recorder.rank < 0:
        return None
    if recorder.rank != 0 and not settings.all_ranks:
        return None
    port, textfile = process_outputs(settings)
    try:
        exporter = Exporter(recorder, dataclasses.replace(settings, port=port, textfile=textfile))
        exporter.start()
    except Exception as exc:  # prometheus_client missing or broken: the job matters more
        log.warning("warmstart: live metrics off: %s: %s", type(exc).__name__, exc)
        return None
    return exporter


def _after_fork_in_child() -> None:
    for exporter in list(_exporters):
        exporter._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
