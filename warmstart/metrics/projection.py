"""ETT% projected to another job size and length (docs/metrics.md#projecting-ett-to-another-scale).

Two steps, both pure. :func:`measure` reads what one measured run cost per event: a start, a recovery,
a checkpoint, a failure's lost progress, and the share of loop time spent in other spans (eval). Then
:func:`project` builds a job of N devices running D days from those costs:

* per job, whatever its size: one start (time to start) and one shutdown;
* per failure: one recovery (time to recover) and lost progress, on average half a checkpoint
  interval plus the detection delay (how long the failing step ran past a normal step); without a
  committed checkpoint, everything its attempt trained;
* the failure count scales with devices and time: ``failures = N x hours x rate``, the rate per
  device-hour taken from published reliability figures (:func:`published_mtbf_h`) unless given;
* per checkpoint interval of loop time, whatever the size: one checkpoint's blocking time.

With neither devices nor days given, the run's own size, duration, failure count and checkpoint
interval are used, with what its failures lost and its share of loop time blocked on checkpoints as
measured: the projection then reproduces the run's measured ETT%, and shows beside it what the model
would have charged per failure. It does not model start-up growing with the job's size: the
per-start and per-recovery costs are the run's own.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import defaultdict
from typing import Any, NamedTuple

from warmstart.errors import ConfigError, WarmstartError
from warmstart.metrics.advisor import SECONDS_PER_DAY, advise_interval
from warmstart.metrics.buckets import CHECKPOINT_BLOCKING, EFFECTIVE, INIT_OTHER, LOST, RECOVERY, SHUTDOWN
from warmstart.metrics.calculator import RunResult, ordered_buckets

#: Mean time to failure of one job of that many GPUs, in hours, from Meta's study of its research
#: clusters (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research
#: Clusters", 2024). The two figures imply a per-GPU failure rate that falls with job size.
PUBLISHED_MTTF_H: tuple[tuple[int, float], ...] = ((1024, 7.9), (16384, 1.8))

# Buckets of the training loop; every other bucket but shutdown and recovery_wait is start-up work.
_LOOP_BUCKETS = (EFFECTIVE, LOST, CHECKPOINT_BLOCKING, "eval")


class ProjectionError(WarmstartError, ValueError):
    """A run cannot be projected (no events, or the projected job is shorter than its own start-up)."""


def published_failure_rate(devices: int) -> float:
    """Failures per device-hour for a job of ``devices`` devices, from :data:`PUBLISHED_MTTF_H`.

    Each published point gives a rate ``1 / (GPUs x MTTF)``. Between the two points the rate is
    interpolated linearly in log(rate) against log(devices) (a power law through both); outside them it
    stays at the nearest point's rate, as there is no figure to extrapolate from.
    """
    (n_lo, mttf_lo), (n_hi, mttf_hi) = PUBLISHED_MTTF_H
    rate_lo, rate_hi = 1.0 / (n_lo * mttf_lo), 1.0 / (n_hi * mttf_hi)
    if devices <= n_lo:
        return rate_lo
    if devices >= n_hi:
        return rate_hi
    x = math.log(devices / n_lo) / math.log(n_hi / n_lo)
    return math.exp(math.log(rate_lo) + x * (math.log(rate_hi) - math.log(rate_lo)))


def published_mtbf_h(devices: int) -> float:
    """Mean time between failures, in hours, of a job of ``devices`` devices (:func:`published_failure_rate`)."""
    return 1.0 / (devices * published_failure_rate(devices))


@dataclasses.dataclass(frozen=True)
class RunCosts:
    """What one measured run cost, per event: the inputs of :func:`project`. Seconds unless named."""

    job: str
    run_dir: str
    devices: int
    """The largest ``devices`` of its ``attempt_start`` events, or its number of ranks when larger."""
    e2e_s: float
    ett_pct: float
    failures: int
    start_s: float
    """Time to start: paid once per job."""
    recovery_s: float | None
    """Time to recover, per failure; ``None`` when the run never failed (a recovery then costs a start)."""
    shutdown_s: float
    loop_s: float
    """Time in the training loop (from each attempt's first step to its end), all attempts."""
    checkpoints: int
    blocking_s: float
    """Blocking time per checkpoint."""
    interval_s: float | None
    """Checkpoint interval: the median time between consecutive commits of an attempt; with no attempt
    committing twice, the median time from an attempt's first step to its first commit (else the loop
    time per checkpoint); ``None`` without a commit."""
    blocking_loop_pct: float
    """Share of loop time blocked on checkpoints, in %."""
    lost_per_failure_s: float | None
    """Measured lost progress per failure; ``None`` when the run never failed."""
    detection_s: float
    """Per failure: how long the step running at the failure had run beyond the ideal step time."""
    other_loop_pct: float
    """Share of loop time that is neither training nor checkpoint blocking (eval, other spans), in %."""
    start_buckets: dict[str, float]
    """Time to start split into its buckets."""
    recovery_buckets: dict[str, float]
    """One recovery split into its buckets (``recovery_wait`` and the re-start's)."""
    loop_other_buckets: dict[str, float]
    """The loop's other time split into buckets, as shares summing to 1."""
    step_s: float | None = None
    """The ideal step time (the fast steps' typical duration); ``None`` with too few steps."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)


def measure(result: RunResult) -> RunCosts:
    """The per-event costs of one computed run.

    Raises:
        ProjectionError: the run has no attempts (no events).
    """
    if not result.attempts or result.ett_pct is None:  # a window without counted time has no ETT%
        raise ProjectionError(f"{result.run_dir}: job {result.job} has no events to project from")
    l1, buckets = result.l1, result.buckets
    failures = int(l1["failures"])
    start, recover, shutdown = l1["time_to_start_s"], l1["time_to_recover_s"], l1["shutdown_s"]
    loop = max(result.e2e_s - start - recover - shutdown, 0.0)
    blocking = buckets.get(CHECKPOINT_BLOCKING, 0.0)
    commits = [sorted(ts for ts, _ in tl.checkpoints) for tl in result.timeline]
    checkpoints = sum(map(len, commits))
    interval = _interval(result, commits, loop)
    other = max(loop - buckets.get(EFFECTIVE, 0.0) - buckets.get(LOST, 0.0) - blocking, 0.0)
    startup = _startup_split(result, start, recover)
    return RunCosts(
        job=result.job,
        run_dir=result.run_dir,
        devices=max(result.devices, len(result.ranks), 1),
        e2e_s=result.e2e_s,
        ett_pct=result.ett_pct,
        failures=failures,
        start_s=start,
        recovery_s=recover / failures if failures else None,
        shutdown_s=shutdown,
        loop_s=loop,
        checkpoints=max(checkpoints, 1 if blocking else 0),
        blocking_s=blocking / max(checkpoints, 1),
        interval_s=interval,
        blocking_loop_pct=100.0 * blocking / loop if loop else 0.0,
        lost_per_failure_s=buckets.get(LOST, 0.0) / failures if failures else None,
        detection_s=_detection_s(result, failures),
        other_loop_pct=100.0 * other / loop if loop else 0.0,
        start_buckets=startup.start,
        recovery_buckets={k: v / failures for k, v in startup.recovery.items()} if failures else dict(startup.start),
        loop_other_buckets=_scaled(startup.loop_leftover, 1.0) if other else {},
        step_s=result.slow_steps.ideal_step_s if result.slow_steps is not None else None,
    )


def _detection_s(result: RunResult, failures: int) -> float:
    """Per failure, how long the step running at it ran beyond the ideal step time."""
    slow = result.slow_steps
    if not failures or slow is None or slow.ideal_step_s is None:
        return 0.0
    ideal = slow.ideal_step_s
    return sum(max(s.running_s - ideal, 0.0) for s in slow.interrupted) / failures


class _StartupSplit(NamedTuple):
    """Start-up time split into buckets, and what start-up buckets leave to the loop."""

    start: dict[str, float]
    """The time to start."""
    recovery: dict[str, float]
    """All the time to recover (``recovery_wait`` included)."""
    loop_leftover: dict[str, float]
    """Start-up buckets' seconds beyond those, and eval: the loop's other time."""


def _startup_split(result: RunResult, start: float, recover: float) -> _StartupSplit:
    """The L2 split of the time to start, of the time to recover, and of the start-up buckets' rest.

    Attempt 0's start-up buckets are scaled to its time to start, the later attempts' to their share of
    the time to recover. A start-up bucket with more seconds than that (torch.compile compiling lazily
    inside step 0) leaves the rest in the loop, with eval.
    """
    buckets = result.buckets
    first, later = _startup_buckets(result.attempts[:1]), _startup_buckets(result.attempts[1:])
    start_buckets = _scaled(first, start)
    waited = buckets.get(RECOVERY, 0.0)
    recovered = _scaled(later, recover - waited)
    if waited:
        recovered[RECOVERY] = waited
    leftover = {
        name: seconds - start_buckets.get(name, 0.0) - recovered.get(name, 0.0)
        for name, seconds in _startup_buckets(result.attempts).items()
    }
    leftover["eval"] = buckets.get("eval", 0.0)
    return _StartupSplit(start_buckets, recovered, leftover)


def _interval(result: RunResult, commits: list[list[float]], loop: float) -> float | None:
    gaps = [b - a for ts in commits for a, b in itertools.pairwise(ts)]
    if gaps:
        return statistics.median(gaps)
    # One commit per attempt: an attempt starts from its last checkpoint (or step 0), so its first
    # commit comes one interval after its first step.
    firsts = [
        ts[0] - tl.first_step
        for tl, ts in zip(result.timeline, commits, strict=True)
        if ts and tl.first_step is not None and ts[0] > tl.first_step
    ]
    if firsts:
        return statistics.median(firsts)
    checkpoints = sum(map(len, commits))
    return loop / checkpoints if checkpoints else None


def _startup_buckets(attempts) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for attempt in attempts:
        for name, seconds in attempt.buckets.items():
            if name not in _LOOP_BUCKETS and name not in (SHUTDOWN, RECOVERY) and seconds > 0:
                out[name] += seconds
    return out


def _scaled(parts: dict[str, float], total: float) -> dict[str, float]:
    """``parts`` (negative ones dropped) rescaled to sum to ``total``; all ``init_other`` when empty."""
    parts = {k: v for k, v in parts.items() if v > 0}
    whole = sum(parts.values())
    if total <= 0:
        return {}
    if whole <= 0:
        return {INIT_OTHER: total}
    return {k: total * v / whole for k, v in parts.items()}


@dataclasses.dataclass(frozen=True)
class Scale:
    """The job to project to; a field left ``None`` takes the run's own (see :func:`project`)."""

    devices: int | None = None
    """Devices of the projected job."""
    days: float | None = None
    """Its end-to-end time, in days."""
    mtbf_h: float | None = None
    """Its mean time between failures, in hours (default: the published figures at its size)."""
    checkpoint_interval_s: float | None = None
    """Its checkpoint interval (default: the advisor's optimum; the run's own with neither devices nor days)."""
    snapshot_every: int | None = None
    """Per-step snapshots every this many steps (docs/checkpoint.md#per-step-snapshots): a failure
    then loses half that many steps plus detection, whatever the checkpoint interval."""

    def __post_init__(self) -> None:
        if self.devices is not None and (
            isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1
        ):
            raise ConfigError("--devices", self.devices, "a whole number of devices, at least 1")
        for option, value, accepted in (
            ("--days", self.days, "a positive number of days"),
            ("--mtbf-h", self.mtbf_h, "a positive number of hours"),
            ("--checkpoint-interval", self.checkpoint_interval_s, "a positive number of seconds"),
        ):
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(option, value, accepted)
        if self.snapshot_every is not None and (
            isinstance(self.snapshot_every, bool) or not isinstance(self.snapshot_every, int) or self.snapshot_every < 1
        ):
            raise ConfigError("--snapshot-every", self.snapshot_every, "a whole number of steps, at least 1")

    @property
    def own(self) -> bool:
        """Neither devices nor days given: the run's own size, duration, failures and interval."""
        return self.devices is None and self.days is None


@dataclasses.dataclass(frozen=True)
class Projection:
    """ETT% and its breakdown for one run's costs at one scale; the ``warmstart ett project --json`` object."""

    costs: RunCosts
    devices: int
    days: float
    e2e_s: float
    projected_ett_pct: float
    failures: float
    """Expected failures over the projected job (a fraction when the projection is not the run itself)."""
    failures_from: str
    """``run`` (its own count), ``option`` (``--mtbf-h``) or ``published`` (:data:`PUBLISHED_MTTF_H`)."""
    mtbf_h: float | None
    checkpoint_interval_s: float | None
    interval_from: str
    """``run`` (its own), ``option`` (``--checkpoint-interval``) or ``advisor`` (the optimum)."""
    lost_per_failure_s: float
    lost_from: str
    """``run`` (what the run's own failures lost), ``model`` (half an interval plus detection),
    ``snapshots`` (half of ``snapshot_every`` steps plus detection) or ``attempt`` (no committed
    checkpoint: a failure loses all its attempt trained)."""
    model_lost_per_failure_s: float | None
    """What the model charges per failure at this interval (half of it plus detection); ``None``
    without a checkpoint interval."""
    recovery_s: float
    first_order_valid: bool
    """False when the checkpoint interval is not small against the time between failures (above half)."""
    l1: dict[str, Any]
    buckets: dict[str, float]
    snapshot_every: int | None = None
    """Per-step snapshots every this many steps (``None``: periodic checkpoints only)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict: the projection, the inputs it used, and what was measured."""
        hours = self.e2e_s / 3600.0
        return {
            "job": self.costs.job,
            "run_dir": self.costs.run_dir,
            "devices": self.devices,
            "days": self.days,
            "e2e_s": self.e2e_s,
            "projected_ett_pct": self.projected_ett_pct,
            "measured_ett_pct": self.costs.ett_pct,
            "l1": dict(self.l1),
            "buckets": dict(self.buckets),
            "inputs": {
                "devices": self.devices,
                "days": self.days,
                "mtbf_h": self.mtbf_h,
                "failures_per_device_hour": self.failures / (self.devices * hours) if hours else 0.0,
                "failures_from": self.failures_from,
                "checkpoint_interval_s": self.checkpoint_interval_s,
                "interval_from": self.interval_from,
                "snapshot_every": self.snapshot_every,
                "start_s": self.costs.start_s,
                "recovery_s": self.recovery_s,
                "blocking_per_checkpoint_s": self.costs.blocking_s,
                "lost_per_failure_s": self.lost_per_failure_s,
                "lost_from": self.lost_from,
                "model_lost_per_failure_s": self.model_lost_per_failure_s,
                "detection_s": self.costs.detection_s,
                "shutdown_s": self.costs.shutdown_s,
                "other_loop_pct": self.costs.other_loop_pct,
                "first_order_valid": self.first_order_valid,
            },
            "measured": self.costs.to_dict(),
        }


def project(costs: RunCosts, scale: Scale = Scale()) -> Projection:
    """ETT% and its breakdown for a job of ``scale.devices`` devices running ``scale.days`` days.

    With neither devices nor days, the run's own size, duration, failure count and checkpoint interval
    (``scale.mtbf_h`` and ``scale.checkpoint_interval_s`` still override theirs). Otherwise a missing
    devices or days is the run's own, the failure rate is the published one at that size unless
    ``mtbf_h`` is given, and the interval the advisor's optimum for the run's blocking time per
    checkpoint and the projected failure rate unless given.

    What a failure loses: at the run's own scale and interval, what the run's failures lost (so the
    projection reproduces the measured ETT%); else half the interval plus the detection delay; and
    without a committed checkpoint everything its attempt trained: the job keeps, on average, the
    training after its last failure, ``trainable x (1 - e^-F) / F`` for F failures at random times.
    Blocking: with the run's own interval, the run's share of loop time; else one checkpoint's
    blocking per interval.

    Raises:
        ProjectionError: start-up, shutdown and recoveries alone outlast the projected job.
    """
    devices = scale.devices or costs.devices
    e2e = scale.days * SECONDS_PER_DAY if scale.days is not None else costs.e2e_s
    failures = _expected_failures(costs, scale, devices, e2e / 3600.0)
    interval = _checkpoint_interval(costs, scale, failures.expected, e2e)
    recovery = costs.recovery_s if costs.recovery_s is not None else costs.start_s

    # Fixed costs first, then the loop gets the rest; within it blocking and other spans take their
    # shares of loop time, failures their lost progress, and training what remains.
    recover = failures.expected * recovery
    loop = e2e - costs.start_s - costs.shutdown_s - recover
    if loop < 0:
        raise ProjectionError(
            f"{costs.run_dir}: job {costs.job}: start-up, shutdown and {failures.expected:.1f} recoveries take "
            f"{e2e - loop:,.0f} s, longer than the projected {e2e:,.0f} s"
        )
    split = _split_loop(costs, loop, failures, interval, scale.snapshot_every)
    l1 = {
        "time_to_start_s": costs.start_s,
        "time_to_recover_s": recover,
        "failures": failures.expected,
        "lost_progress_s": split.lost.seconds,
        "checkpoint_blocking_s": split.blocking,
        "shutdown_s": costs.shutdown_s,
    }
    return Projection(
        costs=costs,
        devices=devices,
        days=e2e / SECONDS_PER_DAY,
        e2e_s=e2e,
        projected_ett_pct=100.0 * split.effective / e2e if e2e else 0.0,
        failures=failures.expected,
        failures_from=failures.source,
        mtbf_h=failures.mtbf_h,
        checkpoint_interval_s=interval.seconds,
        interval_from=interval.source,
        lost_per_failure_s=split.lost.seconds / failures.expected if failures.expected else 0.0,
        lost_from=split.lost.source,
        model_lost_per_failure_s=split.lost.model_per_failure_s,
        recovery_s=recovery,
        first_order_valid=_first_order_valid(interval.seconds, failures.mtbf_h),
        l1=l1,
        buckets=_projected_buckets(costs, failures.expected, split),
        snapshot_every=scale.snapshot_every,
    )


class _Failures(NamedTuple):
    """The projected job's failures."""

    expected: float
    """Over the job: a fraction unless it is the run's own count."""
    mtbf_h: float | None
    source: str
    """Where the rate came from: see :attr:`Projection.failures_from`."""


class _Interval(NamedTuple):
    """The projected job's checkpoint interval."""

    seconds: float | None
    source: str
    """Where it came from: see :attr:`Projection.interval_from`."""


class _Lost(NamedTuple):
    """The progress the projected job's failures lose."""

    seconds: float
    source: str
    """How it was found: see :attr:`Projection.lost_from`."""
    model_per_failure_s: float | None


class _LoopSplit(NamedTuple):
    """The projected job's loop time, by what it went to."""

    blocking: float
    other: float
    lost: _Lost
    effective: float


def _expected_failures(costs: RunCosts, scale: Scale, devices: int, hours: float) -> _Failures:
    if scale.mtbf_h is not None:
        return _Failures(hours / scale.mtbf_h, scale.mtbf_h, "option")
    if scale.own:
        failures = float(costs.failures)
        return _Failures(failures, hours / failures if failures else None, "run")
    mtbf_h = published_mtbf_h(devices)
    return _Failures(hours / mtbf_h, mtbf_h, "published")


def _checkpoint_interval(costs: RunCosts, scale: Scale, failures: float, e2e: float) -> _Interval:
    if scale.checkpoint_interval_s is not None:
        return _Interval(scale.checkpoint_interval_s, "option")
    if not scale.own and costs.blocking_s > 0 and failures > 0 and costs.interval_s is not None:
        return _Interval(advise_interval(costs.blocking_s, failures / (e2e / SECONDS_PER_DAY)).interval_s, "advisor")
    return _Interval(costs.interval_s, "run")


def _split_loop(
    costs: RunCosts, loop: float, failures: _Failures, interval: _Interval, snapshot_every: int | None = None
) -> _LoopSplit:
    if interval.source == "run" or interval.seconds is None:  # the run's saves, as often as they blocked it
        blocking = loop * costs.blocking_loop_pct / 100.0
    else:
        blocking = min(loop * costs.blocking_s / interval.seconds, loop)
    other = min(loop * costs.other_loop_pct / 100.0, loop - blocking)
    trainable = loop - blocking - other
    lost = _lost_progress(costs, trainable, failures, interval, snapshot_every)
    return _LoopSplit(blocking, other, lost, trainable - lost.seconds)


def _lost_progress(
    costs: RunCosts, trainable: float, failures: _Failures, interval: _Interval, snapshot_every: int | None = None
) -> _Lost:
    model_lost = None if interval.seconds is None else interval.seconds / 2 + costs.detection_s
    expected = failures.expected
    if snapshot_every is not None:
        step_s = costs.step_s if costs.step_s is not None else 0.0
        per_failure = snapshot_every * step_s / 2 + costs.detection_s
        if model_lost is not None:  # a snapshot never loses more than the checkpoint behind it would
            per_failure = min(per_failure, model_lost)
        return _Lost(min(expected * per_failure, trainable), "snapshots", per_failure)
    if failures.source == "run" and interval.source == "run":
        lost, source = expected * (costs.lost_per_failure_s or 0.0), "run"
    elif model_lost is not None:
        lost, source = expected * model_lost, "model"
    else:
        kept = trainable * -math.expm1(-expected) / expected if expected else trainable
        lost, source = trainable - kept, "attempt"
    return _Lost(min(lost, trainable), source, model_lost)


def _projected_buckets(costs: RunCosts, failures: float, split: _LoopSplit) -> dict[str, float]:
    buckets: dict[str, float] = defaultdict(float)
    for name, seconds in costs.start_buckets.items():
        buckets[name] += seconds
    for name, seconds in costs.recovery_buckets.items():
        buckets[name] += failures * seconds
    for name, share in costs.loop_other_buckets.items():
        buckets[name] += split.other * share
    buckets[EFFECTIVE] += split.effective
    buckets[LOST] += split.lost.seconds
    buckets[CHECKPOINT_BLOCKING] += split.blocking
    buckets[SHUTDOWN] += costs.shutdown_s
    return ordered_buckets(buckets)


def _first_order_valid(interval: float | None, mtbf_h: float | None) -> bool:
    # The first-order optimum holds while an interval is small against the time between failures.
    return interval is None or mtbf_h is None or interval <= mtbf_h * 3600.0 / 2
