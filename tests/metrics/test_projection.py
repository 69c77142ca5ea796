"""ETT% projected to another scale: hand-computed costs and projections, the self-check (the run's own
scale reproduces its measured ETT% within a point), the published failure rates, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from _timelines import ev, run_of, span
from click.testing import CliRunner

from warmstart.cli import cli
from warmstart.errors import ConfigError
from warmstart.metrics.events import write_events
from warmstart.metrics.projection import (
    ProjectionError,
    Scale,
    measure,
    project,
    published_failure_rate,
    published_mtbf_h,
)

APPROX = {"abs": 1e-4}
WEEK_S = 7 * 86400


def _job(job: str = "job-1") -> list[list[dict]]:
    """A job of 4 devices, one failure, a commit every 10 s, each event placed for easy sums:

    attempt 0: start-up 0-10 (compile); steps 0-24 at 10..34, 1 s each; saves block 0.5 s at 19.5 and
    29.5, committing steps 9 and 19 at 20 and 30; it fails at 35: steps 20-24 (30-35) are lost,
    exactly half the 10 s interval, and the last step ran 1 s (the ideal) before the failure.
    attempt 1: rescheduled at 40 (5 s of recovery_wait), checkpoint_load 40-44, compile 44-46, steps
    20-43 at 46..69, saves at 55.5 and 65.5 (commits at 56 and 66), train_end at 70, attempt_end 72.
    """
    a0 = [ev(0, "attempt_start", job=job, devices=4), *span(0, 10, "compile", job=job)]
    a0 += [ev(10 + i, "step", job=job, step=i) for i in range(25)]
    for t, step in ((19.5, 9), (29.5, 19)):
        a0 += [*span(t, t + 0.5, "checkpoint_save", job=job), ev(t + 0.5, "checkpoint_committed", job=job, step=step)]
    a0 += [ev(35, "failure", job=job, reason="NCCL timeout", category="infra"), ev(36, "attempt_end", job=job)]
    a1 = [
        ev(40, "attempt_start", 1, job=job, devices=4),
        *span(40, 44, "checkpoint_load", 1, job=job),
        *span(44, 46, "compile", 1, job=job),
    ]
    a1 += [ev(46 + i, "step", 1, job=job, step=20 + i) for i in range(24)]
    for t, step in ((55.5, 29), (65.5, 39)):
        a1 += [
            *span(t, t + 0.5, "checkpoint_save", 1, job=job),
            ev(t + 0.5, "checkpoint_committed", 1, job=job, step=step),
        ]
    a1 += [ev(70, "train_end", 1, job=job), ev(72, "attempt_end", 1, job=job)]
    return [a0, a1]


def test_measured_costs(tmp_path):
    res = run_of(tmp_path, *_job())
    # e2e 72 = start 10 + loop 25 + recovery 11 + loop 24 + shutdown 2; effective 19 + 23 = 42.
    assert res.ett_pct == pytest.approx(100 * 42 / 72)
    costs = measure(res)
    assert (costs.devices, costs.failures, costs.checkpoints) == (4, 1, 4)
    assert costs.start_s == pytest.approx(10, **APPROX)
    assert costs.recovery_s == pytest.approx(5 + 4 + 2, **APPROX)
    assert costs.shutdown_s == pytest.approx(2, **APPROX)
    assert costs.loop_s == pytest.approx(49, **APPROX)
    assert costs.blocking_s == pytest.approx(0.5, **APPROX)  # 2 s over 4 checkpoints
    assert costs.interval_s == pytest.approx(10, **APPROX)  # commits 20 -> 30 and 56 -> 66
    assert costs.lost_per_failure_s == pytest.approx(5, **APPROX)
    assert costs.detection_s == pytest.approx(0, **APPROX)  # the failing step had run 1 s, the ideal
    assert costs.other_loop_pct == pytest.approx(0, **APPROX)
    assert costs.start_buckets == {"compile": pytest.approx(10, **APPROX)}
    assert costs.recovery_buckets == pytest.approx({"recovery_wait": 5, "checkpoint_load": 4, "compile": 2}, **APPROX)


def test_own_scale_reproduces_the_measured_ett(tmp_path):
    res = run_of(tmp_path, *_job())
    p = project(measure(res))
    # The run's own: 1 failure, interval 10 s. loop = 72 - 10 - 2 - 11 = 49; the run's saves blocked
    # 2 s of it and its failure lost 5 s, which is also what the model charges (10 / 2 + 0).
    assert (p.devices, p.failures, p.failures_from, p.interval_from, p.lost_from) == (4, 1.0, "run", "run", "run")
    assert p.l1["checkpoint_blocking_s"] == pytest.approx(2, **APPROX)
    assert p.l1["lost_progress_s"] == pytest.approx(5, **APPROX)
    assert p.model_lost_per_failure_s == pytest.approx(5, **APPROX)
    assert p.projected_ett_pct == pytest.approx(res.ett_pct, **APPROX)
    assert math.isclose(sum(p.buckets.values()), p.e2e_s, abs_tol=1e-6)


def _one_commit_then_restart() -> list[list[dict]]:
    """One commit, a failure 25 s after it, and a restart from it that trains to the end uncommitted:

    attempt 0: start-up 0-20 (compile), steps 0-74 at 20..95 (1 s each), the save of step 49 blocks
    0.5 s at 70 and commits at 70.5, the failure at 95.5 loses steps 50-74 (25 s). attempt 1: started
    at 100, start-up 100-110, steps 50-99 at 110..160, train_end 160, attempt_end 162.
    """
    a0 = [ev(0, "attempt_start", devices=2), *span(0, 20, "compile")]
    a0 += [ev(20 + i + (0.5 if i >= 50 else 0), "step", step=i) for i in range(75)]
    a0 += [*span(70, 70.5, "checkpoint_save"), ev(70.5, "checkpoint_committed", step=49)]
    a0 += [ev(95.5, "failure", reason="injected", category="infra"), ev(96, "attempt_end")]
    a1 = [ev(100, "attempt_start", 1, devices=2), *span(100, 110, "checkpoint_load", 1)]
    a1 += [ev(110 + i, "step", 1, step=50 + i) for i in range(50)]
    a1 += [ev(160, "train_end", 1), ev(162, "attempt_end", 1)]
    return [a0, a1]


def test_one_commit_and_a_restart_from_it_projects_onto_itself(tmp_path):
    res = run_of(tmp_path, *_one_commit_then_restart())
    assert res.l1["lost_progress_s"] == pytest.approx(25, **APPROX)
    costs = measure(res)
    # One commit per attempt: the interval is from the attempt's first step to its commit (50.5 s),
    # not the loop time per checkpoint (125.5 s).
    assert costs.interval_s == pytest.approx(50.5, **APPROX)
    p = project(costs)
    assert abs(p.projected_ett_pct - res.ett_pct) < 1
    assert p.lost_from == "run" and p.lost_per_failure_s == pytest.approx(25, **APPROX)
    assert p.model_lost_per_failure_s == pytest.approx(25.25, **APPROX)  # what it charges elsewhere


def _several_attempts() -> list[list[dict]]:
    """Three attempts, two failures late in their intervals, commits every 10 steps of 1 s: attempt 0
    fails 9 s after its commit of step 19, attempt 1 (from step 20) 8 s after its commit of step 39,
    attempt 2 (from step 40) trains to step 69 and ends."""
    files, t = [], 0.0
    for attempt, (first, last, fail) in enumerate(((0, 28, True), (20, 47, True), (40, 69, False))):
        events = [ev(t, "attempt_start", attempt, devices=8), *span(t, t + 5, "compile", attempt)]
        t += 5
        for step in range(first, last + 1):
            events.append(ev(t, "step", attempt, step=step))
            t += 1
            if step % 10 == 9:
                events += [
                    *span(t, t + 0.25, "checkpoint_save", attempt),
                    ev(t + 0.25, "checkpoint_committed", attempt, step=step),
                ]
                t += 0.25
        events.append(
            ev(
                t,
                "failure" if fail else "train_end",
                attempt,
                **({"reason": "node lost", "category": "infra"} if fail else {}),
            )
        )
        events.append(ev(t + 1, "attempt_end", attempt))
        t += 4
        files.append(events)
    return files


def test_several_attempts_project_onto_themselves(tmp_path):
    res = run_of(tmp_path, *_several_attempts())
    assert res.l1["failures"] == 2 and res.l1["lost_progress_s"] == pytest.approx(9 + 8, **APPROX)
    p = project(measure(res))
    assert p.failures == 2 and abs(p.projected_ett_pct - res.ett_pct) < 1
    assert p.l1["checkpoint_blocking_s"] == pytest.approx(res.l1["checkpoint_blocking_s"], **APPROX)


def _no_checkpoint() -> list[list[dict]]:
    """Failures and no checkpoint at all: attempt 0 trains 40 s and dies, attempt 1 trains from step 0
    again for 60 s and ends."""
    a0 = [ev(0, "attempt_start", devices=4), *span(0, 10, "compile")]
    a0 += [ev(10 + i, "step", step=i) for i in range(40)] + [ev(50, "failure", reason="oom", category="user")]
    a1 = [ev(55, "attempt_start", 1, devices=4), *span(55, 65, "compile", 1)]
    a1 += [ev(65 + i, "step", 1, step=i) for i in range(60)] + [ev(125, "train_end", 1), ev(126, "attempt_end", 1)]
    return [a0, a1]


def test_no_checkpoint_loses_every_failed_attempt(tmp_path):
    res = run_of(tmp_path, *_no_checkpoint())
    costs = measure(res)
    assert costs.interval_s is None and costs.lost_per_failure_s == pytest.approx(40, **APPROX)
    own = project(costs)
    assert abs(own.projected_ett_pct - res.ett_pct) < 1
    # At 1,024 devices for 7 days (MTBF 7.9 h, 21.3 failures) each failure loses all its attempt
    # trained: the job keeps the training after its last failure, about an MTBF of 168 h.
    p = project(costs, Scale(devices=1024, days=7))
    assert p.lost_from == "attempt" and p.checkpoint_interval_s is None
    failures = 168 / 7.9
    loop = WEEK_S - 10 - 1 - failures * (5 + 10)
    assert p.projected_ett_pct == pytest.approx(100 * loop * (1 - math.exp(-failures)) / failures / WEEK_S, **APPROX)
    assert 3 < p.projected_ett_pct < 6  # near MTBF / duration = 4.7%


def test_projection_with_given_failure_rate_and_interval(tmp_path):
    p = project(measure(run_of(tmp_path, *_job())), Scale(devices=1024, days=7, mtbf_h=24, checkpoint_interval_s=600))
    # 168 h / 24 h = 7 failures, each recovering in 11 s and losing 600 / 2 = 300 s.
    # loop = 604800 - 10 - 2 - 77 = 604711; blocking = 604711 x 0.5 / 600; lost = 2100.
    loop = WEEK_S - 10 - 2 - 77
    blocking = loop * 0.5 / 600
    assert p.failures == pytest.approx(7) and p.failures_from == "option" and p.interval_from == "option"
    assert p.l1 == pytest.approx(
        {
            "time_to_start_s": 10,
            "time_to_recover_s": 77,
            "failures": 7,
            "lost_progress_s": 2100,
            "checkpoint_blocking_s": blocking,
            "shutdown_s": 2,
        },
        **APPROX,
    )
    assert p.projected_ett_pct == pytest.approx(100 * (loop - blocking - 2100) / WEEK_S, **APPROX)
    # Start-up as measured; each recovery split as the run's was; the rest as the model says.
    nonzero = {k: v for k, v in p.buckets.items() if v}
    assert nonzero == pytest.approx(
        {
            "effective_training": loop - blocking - 2100,
            "compile": 10 + 7 * 2,
            "checkpoint_load": 7 * 4,
            "recovery_wait": 7 * 5,
            "lost_progress": 2100,
            "checkpoint_blocking": blocking,
            "shutdown": 2,
        },
        **APPROX,
    )
    assert sum(p.buckets.values()) == pytest.approx(WEEK_S)


def test_per_step_snapshots_lose_half_their_steps_per_failure_instead_of_half_an_interval(tmp_path):
    costs = measure(run_of(tmp_path, *_job()))
    assert costs.step_s == pytest.approx(1.0, rel=0.05)  # the job's steps take 1 s
    scale = Scale(devices=1024, days=7, mtbf_h=24, checkpoint_interval_s=600)
    periodic = project(costs, scale)
    snapshots = project(costs, Scale(devices=1024, days=7, mtbf_h=24, checkpoint_interval_s=600, snapshot_every=1))
    assert snapshots.lost_from == "snapshots" and snapshots.snapshot_every == 1
    per_failure = costs.step_s / 2 + costs.detection_s
    assert snapshots.lost_per_failure_s == pytest.approx(per_failure, **APPROX)
    assert snapshots.l1["lost_progress_s"] == pytest.approx(7 * per_failure, **APPROX)
    # the same job otherwise: only the lost progress differs, and it goes to training
    gained = periodic.l1["lost_progress_s"] - snapshots.l1["lost_progress_s"]
    assert snapshots.projected_ett_pct - periodic.projected_ett_pct == pytest.approx(100 * gained / WEEK_S, **APPROX)
    # snapshots every 2000 steps would lose more than half the interval: never charged above it
    sparse = project(costs, dataclasses.replace(scale, snapshot_every=2000))
    assert sparse.lost_per_failure_s == pytest.approx(periodic.model_lost_per_failure_s, **APPROX)
    with pytest.raises(ConfigError, match="--snapshot-every"):
        Scale(snapshot_every=0)


def test_cli_projects_each_run_with_and_without_snapshots(tmp_path):
    _write(tmp_path / "job", "job-1")
    args = ["ett", "project", str(tmp_path / "job"), "--devices", "1024", "--days", "7", "--snapshot-every", "1"]
    done = CliRunner().invoke(cli, [*args, "--json"])
    assert done.exit_code == 0, done.output
    periodic, snapshots = json.loads(done.output)
    assert periodic["inputs"]["snapshot_every"] is None and snapshots["inputs"]["snapshot_every"] == 1
    assert snapshots["projected_ett_pct"] > periodic["projected_ett_pct"]
    table = CliRunner().invoke(cli, [*args, "--devices", "1024"]).output
    assert "job-1 + snapshots" in table and "every 1 step" in table and "snapshot steps / 2" in table


def test_projection_defaults_published_rate_and_advised_interval(tmp_path):
    p = project(measure(run_of(tmp_path, *_job())), Scale(devices=1024, days=7))
    # 1,024 devices: MTBF 7.9 h, 168 / 7.9 failures. Advisor: sqrt(2 x 7.9 h x 0.5 s) = sqrt(28440) s.
    failures = 168 / 7.9
    interval = math.sqrt(2 * 7.9 * 3600 * 0.5)
    loop = WEEK_S - 10 - 2 - failures * 11
    blocking = loop * 0.5 / interval
    lost = failures * interval / 2
    assert (p.failures_from, p.interval_from) == ("published", "advisor")
    assert p.mtbf_h == pytest.approx(7.9) and p.checkpoint_interval_s == pytest.approx(interval)
    assert p.projected_ett_pct == pytest.approx(100 * (loop - blocking - lost) / WEEK_S, **APPROX)
    d = p.to_dict()
    assert d["inputs"]["failures_per_device_hour"] == pytest.approx(1 / (1024 * 7.9))
    assert d["inputs"]["interval_from"] == "advisor" and d["measured"]["failures"] == 1
    # Scale changes only failures: 16,384 devices fail every 1.8 h, so ETT% drops.
    big = project(measure(run_of(tmp_path, *_job())), Scale(devices=16384, days=7))
    assert big.failures == pytest.approx(168 / 1.8) and big.projected_ett_pct < p.projected_ett_pct


def test_published_failure_rates():
    assert published_mtbf_h(1024) == pytest.approx(7.9)
    assert published_mtbf_h(16384) == pytest.approx(1.8)
    # Half-way in log(devices): the geometric mean of the two rates; sqrt(7.9 x 1.8) h at 4,096.
    assert published_mtbf_h(4096) == pytest.approx(math.sqrt(7.9 * 1.8))
    # Outside the figures the per-device rate of the nearest one holds: MTBF inversely proportional.
    assert published_failure_rate(8) == published_failure_rate(1024) == pytest.approx(1 / (1024 * 7.9))
    assert published_mtbf_h(512) == pytest.approx(15.8) and published_mtbf_h(32768) == pytest.approx(0.9)


def test_run_without_failures_recovers_at_the_cost_of_a_start(tmp_path):
    events = [ev(0, "attempt_start", devices=8), *span(0, 20, "compile")]
    events += [ev(20 + i, "step", step=i) for i in range(60)]
    for t, step in ((29.5, 9), (39.5, 19), (49.5, 29), (59.5, 39), (69.5, 49)):
        events += [*span(t, t + 0.5, "checkpoint_save"), ev(t + 0.5, "checkpoint_committed", step=step)]
    events += [ev(80, "train_end"), ev(80, "attempt_end")]
    costs = measure(run_of(tmp_path, events))
    assert costs.recovery_s is None and costs.lost_per_failure_s is None
    own = project(costs)
    # The run's own saves: 5 of them blocked 2.5 s of the 60 s loop (57.5 s trained).
    assert own.projected_ett_pct == pytest.approx(100 * 57.5 / 80, **APPROX)
    p = project(costs, Scale(days=1, mtbf_h=12, checkpoint_interval_s=100))
    # 2 failures, each paying a 20 s start again and losing 50 s.
    assert p.recovery_s == pytest.approx(20) and p.l1["time_to_recover_s"] == pytest.approx(40)
    assert p.l1["lost_progress_s"] == pytest.approx(100, **APPROX)
    assert p.buckets["compile"] == pytest.approx(20 + 40, **APPROX)


def test_a_run_without_checkpoints_or_failures_projects_without_checkpoints(tmp_path):
    no_checkpoint = [ev(0, "attempt_start"), ev(1, "step", step=0), ev(9, "train_end"), ev(10, "attempt_end")]
    costs = measure(run_of(tmp_path / "a", no_checkpoint))
    assert project(costs).projected_ett_pct == pytest.approx(80)
    # Failures at scale, and nothing committed: each loses its attempt, as in the run with failures.
    p = project(costs, Scale(devices=1024, days=7))
    assert p.lost_from == "attempt" and p.projected_ett_pct < 6
    with_checkpoints = project(costs, Scale(devices=1024, days=7, checkpoint_interval_s=600))
    assert with_checkpoints.lost_from == "model" and with_checkpoints.projected_ett_pct > 90


def test_impossible_projections_are_errors(tmp_path):
    with pytest.raises(ProjectionError, match="longer than the projected"):
        project(measure(run_of(tmp_path / "b", *_job())), Scale(days=10 / 86400))
    with pytest.raises(ProjectionError, match="no events"):
        measure(run_of(tmp_path / "c", []))


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"devices": 0}, "--devices=0"),
        ({"devices": -4}, "--devices=-4"),
        ({"days": 0}, "--days=0"),
        ({"days": -1.5}, "--days=-1.5"),
        ({"days": math.inf}, "--days=inf"),
        ({"mtbf_h": 0}, "--mtbf-h=0"),
        ({"checkpoint_interval_s": -5}, "--checkpoint-interval=-5"),
    ],
)
def test_scale_rejects_bad_values(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        Scale(**kwargs)


# -- the self-check on generated runs shaped like the reference job --------------------------------------


def _reference_like(run_dir, seed: int) -> None:
    """Two ranks, a start-up of 20-40 s, a checkpoint every 30 steps of about 0.12 s (saves blocking
    50-100 ms), a failure at step 75, a restart from step 60 that trains to step 135: the reference
    job's shape, with its timings drawn at random."""
    rng = random.Random(seed)
    ranks: dict[int, list[dict]] = {0: [], 1: []}
    t = 0.0
    for attempt, (first, last) in enumerate(((0, 75), (60, 135))):
        for rank, events in ranks.items():
            events.append(ev(t, "attempt_start", attempt, rank, devices=1))
        start_up = rng.uniform(20, 40)
        for rank, events in ranks.items():
            events += span(t, t + start_up, "compile", attempt, rank)
        t += start_up
        for step in range(first, last + 1):
            for rank, events in ranks.items():
                events.append(ev(t + rng.uniform(0, 0.002), "step", attempt, rank, step=step))
            if step == last and attempt == 0:
                t += rng.uniform(0, 0.01)
                for rank, events in ranks.items():
                    events.append(ev(t, "failure", attempt, rank, reason="injected", category="infra"))
                break
            t += rng.gauss(0.12, 0.01)
            if step % 30 == 29:
                block = rng.uniform(0.05, 0.1)
                for rank, events in ranks.items():
                    events += span(t, t + block, "checkpoint_save", attempt, rank)
                    events.append(ev(t + block, "checkpoint_committed", attempt, rank, step=step))
                t += block
        if attempt == 0:
            for rank, events in ranks.items():
                events.append(ev(t + 0.2, "attempt_end", attempt, rank))
            t += rng.uniform(0.2, 0.5)
    for rank, events in ranks.items():
        events += [ev(t, "train_end", 1, rank), ev(t + 0.3, "attempt_end", 1, rank)]
    for rank, events in ranks.items():
        write_events(run_dir / f"events-r{rank}.jsonl", events)


@pytest.mark.parametrize("seed", range(5))
def test_own_scale_is_within_a_point_on_reference_like_runs(tmp_path, seed):
    _reference_like(tmp_path, seed)
    result = CliRunner().invoke(cli, ["ett", "project", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    (p,) = json.loads(result.stdout)
    assert p["measured"]["failures"] == 1 and p["inputs"]["failures_from"] == "run"
    assert abs(p["projected_ett_pct"] - p["measured_ett_pct"]) < 1


# -- CLI -----------------------------------------------------------------------------------------------


def _write(run_dir, job):
    for i, events in enumerate(_job(job)):
        write_events(run_dir / f"events-a{i}.jsonl", events)


def test_cli_json_keys_and_side_by_side_table(tmp_path):
    _write(tmp_path / "baseline", "baseline")
    _write(tmp_path / "warm", "warm")
    runner = CliRunner()
    args = ["ett", "project", str(tmp_path / "baseline"), str(tmp_path / "warm"), "--devices", "1024", "--days", "7"]
    result = runner.invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)
    assert [r["job"] for r in runs] == ["baseline", "warm"]
    for r in runs:
        assert {
            "projected_ett_pct",
            "measured_ett_pct",
            "l1",
            "buckets",
            "inputs",
            "measured",
            "devices",
            "days",
            "e2e_s",
        } <= set(r)
        assert {
            "time_to_start_s",
            "time_to_recover_s",
            "failures",
            "lost_progress_s",
            "checkpoint_blocking_s",
            "shutdown_s",
        } <= set(r["l1"])
        assert {
            "mtbf_h",
            "checkpoint_interval_s",
            "interval_from",
            "failures_from",
            "start_s",
            "recovery_s",
            "blocking_per_checkpoint_s",
            "lost_per_failure_s",
            "detection_s",
        } <= set(r["inputs"])
        assert math.isclose(sum(r["buckets"].values()), 7 * 86400, rel_tol=1e-9)
        assert (r["devices"], r["days"]) == (1024, 7)
    text = runner.invoke(cli, args).stdout
    assert "ETT% projected to 1,024 devices x 7 days" in text
    header = next(line for line in text.splitlines() if "baseline" in line)
    assert "warm" in header  # one column per run, side by side
    for label in (
        "projected ETT%",
        "measured ETT%",
        "failures",
        "checkpoint interval",
        "time to recover",
        "lost progress",
        "checkpoint blocking",
    ):
        assert label in text


@pytest.mark.parametrize(
    "args, named",
    [
        (["--devices", "-1", "--days", "7"], "--devices=-1"),
        (["--devices", "0"], "--devices=0"),
        (["--days", "0"], "--days=0.0"),
        (["--days", "-3"], "--days=-3.0"),
        (["--mtbf-h", "0"], "--mtbf-h=0.0"),
        (["--checkpoint-interval", "-10"], "'--checkpoint-interval': '-10' is not a duration"),
    ],
)
def test_cli_bad_values_are_one_line_usage_errors(tmp_path, args, named):
    _write(tmp_path, "job-1")
    result = CliRunner().invoke(cli, ["ett", "project", str(tmp_path), *args])
    assert result.exit_code == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert named in line and "expected" in line


def test_cli_bad_input_exits_2(tmp_path):
    result = CliRunner().invoke(cli, ["ett", "project", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "not a run directory" in result.stderr
    _write(tmp_path / "run", "job-1")
    result = CliRunner().invoke(cli, ["ett", "project", str(tmp_path / "run"), "--days", "0.0001"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "longer than the projected" in line


def test_cli_table_states_the_model_and_what_each_run_rests_on(tmp_path):
    for name, files in (("own", _one_commit_then_restart()), ("bare", _no_checkpoint())):
        for i, events in enumerate(files):
            write_events(tmp_path / name / f"events-a{i}.jsonl", events)
    own = CliRunner().invoke(cli, ["ett", "project", str(tmp_path / "own")])
    text = " ".join(own.stdout.split())
    assert own.exit_code == 0 and "The model: one start-up and one shutdown per job" in text
    assert "as its failures lost" in text and "reproduces the measured ETT%" in text
    scaled = CliRunner().invoke(cli, ["ett", "project", str(tmp_path / "bare"), "--devices", "1024", "--days", "7"])
    text = " ".join(scaled.stdout.split())
    assert scaled.exit_code == 0 and "its attempt: no checkpoint" in text
    assert "job-1 committed no checkpoint: each failure loses all its attempt trained" in text
    assert max(map(len, scaled.stdout.splitlines())) <= 80


def test_report_fleet_and_project_count_the_same_devices(tmp_path):
    """Two ranks, each declaring its own one device: a job of 2 devices everywhere."""
    for rank in (0, 1):
        write_events(
            tmp_path / f"events-r{rank}-a0.jsonl",
            [
                ev(0, "attempt_start", rank=rank, devices=1),
                ev(1, "step", rank=rank, step=0),
                ev(9, "train_end", rank=rank),
                ev(10, "attempt_end", rank=rank),
            ],
        )
    runner = CliRunner()
    (report,) = json.loads(runner.invoke(cli, ["ett", "report", str(tmp_path), "--json"]).stdout)
    fleet = json.loads(runner.invoke(cli, ["ett", "fleet", str(tmp_path), "--json"]).stdout)
    (projected,) = json.loads(runner.invoke(cli, ["ett", "project", str(tmp_path), "--json"]).stdout)
    assert report["devices"] == fleet["runs"][0]["devices"] == projected["devices"] == 2
    assert fleet["device_seconds"] == pytest.approx(2 * 10)
    assert "2 device(s)" in runner.invoke(cli, ["ett", "report", str(tmp_path)]).stdout
