"""The start-up graph: a job's start-up as stages with declared dependencies, run overlapped.

A :class:`StartupGraph` holds :class:`Stage` s. Each stage is a function whose keyword arguments
are the results of the stages it depends on (and of the graph's inputs). :meth:`StartupGraph.run`
starts every stage as soon as its dependencies are done: ``runs_on="thread"`` stages (waiting, I/O,
work that releases the GIL) on their own daemon threads, ``runs_on="process"`` stages (heavy
pure-Python work such as sharding-plan search) in a forked child whose result is pickled back, and
``collective=True`` stages (anything that talks to other ranks) on the calling thread, one at a time,
in the same topological order on every rank, so collectives can never be reordered across ranks.
The first error stops the graph and surfaces as :class:`StageFailed` naming the stage and the rank.
A :class:`FailureChannel` (``stages.StoreFailureChannel`` over torch's TCPStore) tells the other
ranks; a watchdog thread turns a peer's failure, or a collective stage past its timeout, into an
error between stages or, when the calling thread is stuck inside a collective, into a clean abort of
the process after ``abort_grace_s`` so that no rank hangs. Every stage is a span on the metrics
recorder (docs/reference.md#events). This module owns scheduling only: it imports no torch and knows
no TorchRec (``stages.py`` has the ready-made TorchRec stages; ``child_process.py`` runs process stages).

Example:
    >>> g = StartupGraph("startup")
    >>> config = g.add("config", lambda: {"lr": 0.1})
    >>> model = g.add("model", lambda config: f"model(lr={config['lr']})", deps=[config.name])
    >>> g.run()["model"]
    'model(lr=0.1)'
"""

from __future__ import annotations

import dataclasses
import functools
import graphlib
import heapq
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from warmstart.errors import WarmstartError
from warmstart.init_pipeline.child_process import call_in_subprocess

log = logging.getLogger("warmstart.init_pipeline")

RUNS_ON = ("thread", "process", "main", "first")
"""Where a stage runs: its own thread, a forked child process, or the thread that called ``run``;
``first`` stages run on that thread before any other stage, and before the graph's watchdog thread,
starts: work that forks (data loader workers), since a fork while another thread holds a lock (torch's
RNG, the allocator's) can leave the child deadlocked. ``first`` stages may depend only on the graph's
inputs; their ``timeout_s`` is not enforced (no watchdog runs yet), and a peer's failure is heard
once they are done."""

_DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0  # as torch's default process-group timeout
_DEFAULT_ABORT_GRACE_S = 10.0  # a rank stuck in a collective after a failure is aborted after this
_DEFAULT_POLL_S = 0.1  # how often the watchdog looks at timeouts and at the failure channel


class StageFailed(WarmstartError):
    """A start-up stage failed (here or on another rank), or a collective stage timed out.

    Attributes:
        stage: the name of the stage that failed first.
        rank: the rank it failed on.
        reason: ``ExceptionType: message`` of the original error.
        seen_on: the rank raising this error (differs from ``rank`` for a peer's failure).
    """

    def __init__(self, stage: str, rank: int, reason: str, seen_on: int | None = None) -> None:
        self.stage, self.rank, self.reason = stage, rank, reason
        self.seen_on = rank if seen_on is None else seen_on
        where = f"rank {rank}" if self.seen_on == rank else f"rank {rank} (seen on rank {self.seen_on})"
        super().__init__(f"start-up stage {stage!r} failed on {where}: {reason}")

    def __reduce__(self):  # keep the fields across pickling (process stages, broadcasts)
        return (StageFailed, (self.stage, self.rank, self.reason, self.seen_on))


@runtime_checkable
class FailureChannel(Protocol):
    """How ranks tell each other that start-up failed. Both methods must be cheap and never raise."""

    def publish(self, message: str) -> None:
        """Tell every rank (JSON text with ``stage``, ``rank`` and ``reason``)."""
        ...

    def poll(self) -> str | None:
        """The first message any rank published, or ``None``."""
        ...


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of start-up.

    Attributes:
        name: unique name; also the keyword argument dependents receive its result under, and the
            metrics span name.
        fn: the work; called with one keyword argument per dependency.
        deps: names of the stages (or graph inputs) whose results it needs.
        runs_on: ``thread``, ``process``, ``main`` or ``first`` (see :data:`RUNS_ON`); a collective
            stage is a ``main`` stage, so it runs in the graph's fixed order.
        timeout_s: fail the stage (main stages: abort the rank) after this many seconds; ``None``
            means no limit for thread and process stages and the graph's collective timeout for main
            stages.
        bucket: the ETT bucket the span counts toward, when ``name`` is not a known span name.
    """

    name: str
    fn: Callable[..., Any]
    deps: tuple[str, ...] = ()
    runs_on: str = "thread"
    timeout_s: float | None = None
    bucket: str | None = None


@dataclasses.dataclass(frozen=True)
class StageTiming:
    """When a stage ran, in ``time.monotonic()`` seconds relative to the start of ``run``."""

    name: str
    start: float
    end: float
    runs_on: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class StartupResult:
    """What :meth:`StartupGraph.run` returns: every stage's result and timing.

    Attributes:
        values: stage name (and input name) to result.
        timings: stage name to :class:`StageTiming`.
        wall_s: seconds from the start of ``run`` to the end of the last stage.
        deps: stage name to its dependencies (for the critical path).
    """

    values: dict[str, Any]
    timings: dict[str, StageTiming]
    wall_s: float
    deps: dict[str, tuple[str, ...]]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    @property
    def sequential_s(self) -> float:
        """The sum of the stage times: what the same stages would take one after another."""
        return sum(t.seconds for t in self.timings.values())

    def critical_path(self) -> tuple[list[str], float]:
        """The dependency chain with the largest total of measured stage times.

        Returns:
            The stage names along it, first to last, and its total seconds: a lower bound for
            ``wall_s`` whatever the scheduling.
        """
        best: dict[str, tuple[float, list[str]]] = {}
        for name in self.timings:  # timings are inserted in topological order
            before = max(
                (best[d] for d in self.deps.get(name, ()) if d in best), key=lambda item: item[0], default=(0.0, [])
            )
            best[name] = (before[0] + self.timings[name].seconds, [*before[1], name])
        total, path = max(best.values(), key=lambda item: item[0], default=(0.0, []))
        return path, total

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """``(stage, where, start, end, seconds)`` per stage, for a table."""
        return [
            (t.name, t.runs_on, f"{t.start:.3f}", f"{t.end:.3f}", f"{t.seconds:.3f}")
            for t in sorted(self.timings.values(), key=lambda t: t.start)
        ]


class StartupGraph:
    """Start-up stages with dependencies, run overlapped (see the module docstring).

    Args:
        name: the graph's name, used in log lines and failure messages.
        rank: this process's global rank; default ``RANK`` from the environment, else 0.
        recorder: metrics recorder for the stage spans; default ``warmstart.metrics.get_recorder()``
            (a no-op unless metrics are on).
        channel: tells other ranks about a failure and hears about theirs; ``None`` for a
            single-process graph.
        collective_timeout_s: default ``timeout_s`` of main-thread stages.
        abort_grace_s: how long a rank whose main thread is inside a stage when start-up has failed
            (here or on a peer) gets to come out of it before the process is aborted (keep it above
            ``failure_linger_s``, so that the failing rank raises its own error first).
        abort: what aborting means; default: print the reason to stderr, record a failure, and
            ``os._exit(1)`` (a thread cannot interrupt a thread blocked in a collective).
        channel_poll_s: how often the channel is asked about peers' failures (one store request
            per rank each time: keep it well above a millisecond on large jobs).
        failure_linger_s: with a channel, how long a rank whose own stage failed waits before
            raising, so that its peers see the failure before a launcher tears them down (keep it
            above ``channel_poll_s``); a rank raising a peer's failure waits twice as long, so that
            the failing rank exits first, with its own traceback.
    """

    def __init__(
        self,
        name: str = "startup",
        *,
        rank: int | None = None,
        recorder: Any = None,
        channel: FailureChannel | None = None,
        collective_timeout_s: float = _DEFAULT_COLLECTIVE_TIMEOUT_S,
        abort_grace_s: float = _DEFAULT_ABORT_GRACE_S,
        poll_s: float = _DEFAULT_POLL_S,
        abort: Callable[[str], None] | None = None,
        channel_poll_s: float = 0.5,
        failure_linger_s: float = 1.5,
    ) -> None:
        self.name = name
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.recorder = recorder
        self.channel = channel
        self.collective_timeout_s = collective_timeout_s
        self.abort_grace_s = abort_grace_s
        self.poll_s = poll_s
        self.abort = abort or _abort_process
        self.channel_poll_s = channel_poll_s
        self.failure_linger_s = failure_linger_s
        self._stages: dict[str, Stage] = {}

    # -- declaring ---------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        deps: Iterable[str] = (),
        runs_on: str = "thread",
        collective: bool = False,
        timeout_s: float | None = None,
        bucket: str | None = None,
    ) -> Stage:
        """Declare a stage.

        Args:
            name: unique identifier-like name (it becomes a keyword argument of dependents).
            fn: called with one keyword argument per dependency.
            deps: the stages or inputs it needs.
            runs_on: ``thread`` (default), ``process``, ``main`` or ``first`` (before every other
                stage: for work that forks); ``collective=True`` implies ``main``.
            collective: the stage issues collectives: main thread, fixed order.
            timeout_s: see :class:`Stage`.
            bucket: ETT bucket for the span.

        Returns:
            The stage.

        Raises:
            ValueError: a duplicate or non-identifier name, or an unknown ``runs_on``.
        """
        if not name.isidentifier():
            raise ValueError(
                f"stage name {name!r} is not valid: expected a Python identifier "
                "(it is passed to dependents as a keyword argument)"
            )
        if name in self._stages:
            raise ValueError(f"stage {name!r} is declared twice")
        if runs_on not in RUNS_ON:
            raise ValueError(f"runs_on={runs_on!r} is not valid: expected one of {', '.join(RUNS_ON)}")
        if collective:  # the main thread is what keeps collectives in one order on every rank
            runs_on = "main"
        stage = Stage(name, fn, tuple(deps), runs_on, timeout_s, bucket)
        self._stages[name] = stage
        return stage

    @property
    def stages(self) -> dict[str, Stage]:
        return dict(self._stages)

    def order(self, inputs: Iterable[str] = ()) -> list[str]:
        """The stages in topological order, ties broken by declaration order (the collective order).

        Raises:
            ValueError: a dependency is neither a stage nor an input, or the dependencies form a cycle.
        """
        known = set(inputs)
        sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
        for stage in self._stages.values():
            for dep in stage.deps:
                if dep not in self._stages and dep not in known:
                    raise ValueError(
                        f"stage {stage.name!r} depends on {dep!r}, which is neither a stage "
                        f"nor an input (stages: {', '.join(self._stages)})"
                    )
            sorter.add(stage.name, *(d for d in stage.deps if d in self._stages))
        try:
            sorter.prepare()
        except graphlib.CycleError as exc:
            cycle = " -> ".join(reversed(exc.args[1]))  # graphlib lists each stage before a dependent
            raise ValueError(f"the stages {cycle} depend on each other in a cycle (each on the next)") from None
        # Every rank must get the same order (it is the order of the collectives), so of the stages
        # ready at each step the first declared goes next, whatever order graphlib hands them out in.
        index = {name: i for i, name in enumerate(self._stages)}
        ready: list[tuple[int, str]] = []
        order: list[str] = []
        while sorter.is_active():
            for name in sorter.get_ready():
                heapq.heappush(ready, (index[name], name))
            _, name = heapq.heappop(ready)
            order.append(name)
            sorter.done(name)
        return order

    # -- running -----------------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, Any] | None = None, *, sequential: bool = False) -> StartupResult:
        """Run every stage, overlapped; return when all are done.

        Args:
            inputs: values stages may depend on by name, as if they were finished stages.
            sequential: run every stage on the calling thread, one after another, in :meth:`order`
                (process stages still in a child): the baseline the overlap is measured against,
                and a debugging aid.

        Returns:
            Every stage's result and timing.

        Raises:
            StageFailed: a stage failed here or on another rank (the original error is chained), or
                a stage ran past its timeout.
            ValueError: the graph is malformed (see :meth:`order`).
        """
        inputs = dict(inputs or {})
        clash = sorted(set(inputs) & set(self._stages))
        if clash:
            raise ValueError(f"inputs {', '.join(clash)} have the names of stages")
        order = self.order(inputs)
        for name in order:
            stage = self._stages[name]
            early = [d for d in stage.deps if d in self._stages]
            if stage.runs_on == "first" and early:
                raise ValueError(
                    f"stage {name!r} runs first but depends on the stages {', '.join(early)}: "
                    "a 'first' stage may depend only on the graph's inputs"
                )
        return _Run(self, order, inputs, sequential=sequential).execute()


class _Run:
    """One execution of a graph: the shared state of its threads."""

    def __init__(self, graph: StartupGraph, order: list[str], inputs: dict[str, Any], *, sequential: bool) -> None:
        self.graph = graph
        self.order = order
        self.sequential = sequential
        self.stages = graph.stages
        self.values: dict[str, Any] = dict(inputs)
        self.timings: dict[str, StageTiming] = {}
        self.cond = threading.Condition()
        self.started: set[str] = set()
        self.running: dict[str, float] = {}  # thread/process stages: name -> start, for timeouts
        self.main_stage: tuple[str, float, float] | None = None  # (name, start, timeout)
        self.failure: StageFailed | None = None
        self.failing = False  # set by the first failure, before it is published
        self.cause: BaseException | None = None
        self.failed_at: float | None = None
        self.finished = False
        self.before_threads = not sequential  # while the 'first' stages run, nothing else starts
        self.t0 = time.monotonic()
        self.recorder = graph.recorder if graph.recorder is not None else _default_recorder()

    # -- scheduling ------------------------------------------------------------------------------

    def execute(self) -> StartupResult:
        try:
            if not self.sequential:
                # Before the watchdog too: a 'first' stage forks (data loader workers), and a fork must
                # find no other thread of ours (one inside a store call or holding a lock at the fork
                # leaves the child with that lock held forever).
                for name in self.order:
                    if self.stages[name].runs_on == "first":
                        self._run_main(name)
            watchdog = threading.Thread(target=self._watch, name=f"warmstart-{self.graph.name}-watchdog", daemon=True)
            watchdog.start()
            with self.cond:
                self.before_threads = False
                self._start_ready()
            for name in self.order:
                if self.stages[name].runs_on != "main" and not self.sequential:
                    continue
                self._wait(functools.partial(self._deps_done, self.stages[name]))
                self._run_main(name)
            self._wait(lambda: all(n in self.timings for n in self.order))
        except StageFailed as failed:
            if self.graph.channel is not None:
                # Launchers kill the other ranks as soon as one exits. The failing rank waits for its
                # peers to hear (and say) which stage failed; a peer that heard waits twice as long,
                # so the failing rank's own error and traceback come out before anyone is killed.
                own = failed.rank == self.graph.rank
                time.sleep(self.graph.failure_linger_s * (1 if own else 2))
            raise
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify_all()
        return StartupResult(
            values=self.values,
            wall_s=time.monotonic() - self.t0,
            timings={n: self.timings[n] for n in self.order},
            deps={n: self.stages[n].deps for n in self.order},
        )

    def _wait(self, ready: Callable[[], bool]) -> None:
        # Short waits so a failure anywhere (a thread, the watchdog, a peer) is raised promptly.
        with self.cond:
            while not ready():
                self._raise_if_failed()
                self.cond.wait(self.graph.poll_s)
            self._raise_if_failed()

    def _deps_done(self, stage: Stage) -> bool:
        return all(d in self.values for d in stage.deps)

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure from self.cause

    def _start_ready(self) -> None:
        """Start every thread/process stage whose dependencies are done (caller holds ``cond``)."""
        if self.failure is not None or self.sequential or self.before_threads:
            return
        for name in self.order:
            stage = self.stages[name]
            if stage.runs_on in ("main", "first") or name in self.started:
                continue
            if self._deps_done(stage):
                self.started.add(name)
                self.running[name] = time.monotonic()
                threading.Thread(
                    target=self._run_off_main, args=(stage,), daemon=True, name=f"warmstart-stage-{name}"
                ).start()

    def _call(self, stage: Stage) -> Any:
        """The stage's function on its dependencies' results, as a span (process stages in a child)."""
        with self.cond:
            kwargs = {d: self.values[d] for d in stage.deps}
        with self.recorder.span(stage.name, stage.bucket):
            if stage.runs_on == "process":  # on the main thread only in a sequential run
                return call_in_subprocess(stage.fn, kwargs, timeout_s=stage.timeout_s, name=stage.name)
            return stage.fn(**kwargs)

    def _run_off_main(self, stage: Stage) -> None:
        start = time.monotonic()
        try:
            value = self._call(stage)
        except BaseException as exc:  # noqa: BLE001 - any error of a stage fails start-up, named
            self._fail(stage.name, exc)
            return
        end = time.monotonic()
        with self.cond:
            self.running.pop(stage.name, None)
            if self.failure is not None:
                return
            self.values[stage.name] = value
            self.timings[stage.name] = StageTiming(stage.name, start - self.t0, end - self.t0, stage.runs_on)
            self._start_ready()
            self.cond.notify_all()

    def _run_main(self, name: str) -> None:
        stage = self.stages[name]
        timeout = stage.timeout_s if stage.timeout_s is not None else self.graph.collective_timeout_s
        start = time.monotonic()
        with self.cond:
            self.main_stage = (name, start, timeout)
        try:
            value = self._call(stage)
        except BaseException as exc:  # noqa: BLE001
            self._fail(name, exc)
            with self.cond:
                self.main_stage = None
            if not isinstance(exc, Exception):
                raise  # Ctrl-C and SystemExit stay what they are (the threads stop all the same)
            self._raise_if_failed()  # the first failure: a peer's, if this error came from its absence
            raise
        end = time.monotonic()
        with self.cond:
            self.main_stage = None
            self.values[name] = value
            self.timings[name] = StageTiming(
                name,
                start - self.t0,
                end - self.t0,
                stage.runs_on if self.sequential or stage.runs_on == "first" else "main",
            )
            self._start_ready()
            self.cond.notify_all()

    # -- failures --------------------------------------------------------------------------------

    def _fail(
        self,
        stage: str,
        exc: BaseException,
        *,
        rank: int | None = None,
        reason: str | None = None,
        publish: bool = True,
    ) -> None:
        """Record the first failure, tell the peers, wake the main thread."""
        rank = self.graph.rank if rank is None else rank
        if isinstance(exc, StageFailed) and reason is None:
            # A nested graph or a peer's failure: keep the original stage and rank.
            stage, rank, reason = exc.stage, exc.rank, exc.reason
        reason = reason or _describe(exc)
        with self.cond:
            if self.failing:
                return
            self.failing = True
        # Peers hear about it before this rank raises (and possibly exits).
        if publish and self.graph.channel is not None:
            self.graph.channel.publish(json.dumps({"stage": stage, "rank": rank, "reason": reason}))
        with self.cond:
            self.failure = StageFailed(stage, rank, reason, seen_on=self.graph.rank)
            self.cause = exc
            self.failed_at = time.monotonic()
            self.cond.notify_all()
        log.error("warmstart: %s", self.failure)

    def _watch(self) -> None:
        """Timeouts, peers' failures, and aborting a rank stuck in a collective after a failure."""
        channel = self.graph.channel
        next_poll = 0.0
        while True:
            with self.cond:
                if self.finished:
                    return
                self.cond.wait(self.graph.poll_s)
                if self.finished:
                    return
                now = time.monotonic()
                main_stage = self.main_stage
                overdue = [
                    n
                    for n, s in self.running.items()
                    if (limit := self.stages[n].timeout_s) is not None and now - s > limit
                ]
            for name in overdue:
                self._fail(name, TimeoutError(f"still running after {self.stages[name].timeout_s:g} s"))
            if main_stage is not None and now - main_stage[1] > main_stage[2]:
                self._fail(main_stage[0], TimeoutError(f"still running after {main_stage[2]:g} s"))
            if channel is not None and self.failure is None and now >= next_poll:
                next_poll = now + self.graph.channel_poll_s
                message = channel.poll()
                if message is not None:
                    peer = _parse_message(message)
                    self._fail(
                        peer["stage"],
                        StageFailed(peer["stage"], peer["rank"], peer["reason"]),
                        rank=peer["rank"],
                        reason=peer["reason"],
                        publish=False,
                    )
            if (
                self.failure is not None
                and self.failed_at is not None
                and main_stage is not None
                and time.monotonic() - self.failed_at > self.graph.abort_grace_s
            ):
                with self.cond:
                    still_inside = self.main_stage is not None and self.main_stage[0] == main_stage[0]
                if still_inside:
                    self._abort(main_stage[0])
                    return

    def _abort(self, inside: str) -> None:
        message = (
            f"warmstart: {self.failure}; aborting rank {self.graph.rank}, which is stuck in collective stage {inside!r}"
        )
        # os._exit skips the recorder's exit hooks: record why this attempt dies, then flush.
        peer_or_timeout = self.failure is not None and (
            self.failure.rank != self.graph.rank or isinstance(self.cause, TimeoutError)
        )
        try:
            self.recorder.failure(message, "infra" if peer_or_timeout else "user")
            self.recorder.flush()
        except Exception:  # noqa: BLE001 - metrics never stand in the way of the abort
            pass
        if self.failure is not None and self.failure.rank == self.graph.rank and not peer_or_timeout:
            # This rank's own stage failed, and it cannot raise the error: show where it came from.
            assert self.cause is not None
            message += "\n" + "".join(traceback.format_exception(self.cause)).rstrip()
        self.graph.abort(message)


def _describe(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) > 2 and lines[1].startswith("Original Traceback"):
        # Re-raised from a DataLoader worker ("Caught OSError in DataLoader worker process 0."): the
        # worker's own error is the traceback's last line.
        return f"{lines[-1].strip()} (in {lines[0].split(' in ', 1)[-1].rstrip('.')})"
    return f"{type(exc).__name__}: {lines[0]}"


def _parse_message(message: str) -> dict[str, Any]:
    try:
        data = json.loads(message)
        return {"stage": str(data["stage"]), "rank": int(data["rank"]), "reason": str(data["reason"])}
    except (ValueError, KeyError, TypeError):
        return {"stage": "?", "rank": -1, "reason": message}


def _default_recorder() -> Any:
    from warmstart.metrics import get_recorder

    return get_recorder()


def _abort_process(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    logging.shutdown()
    os._exit(1)
