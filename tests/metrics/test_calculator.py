"""Hand-computed timelines for every rule of docs/reference.md#events, and a property test that the buckets always
sum to end-to-end time."""

from __future__ import annotations

import math

import pytest
from _timelines import ev, nonzero, run_of, span
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmstart.metrics.buckets import STANDARD_BUCKETS
from warmstart.metrics.calculator import Run, compute, load_runs
from warmstart.metrics.events import EventFormatError, TornLineWarning, parse_event


def _sums_to_e2e(res) -> None:
    assert math.isclose(sum(res.buckets.values()), res.e2e_s, rel_tol=1e-9, abs_tol=1e-6)
    assert math.isclose(sum(a.e2e_s for a in res.attempts), res.e2e_s, rel_tol=1e-9, abs_tol=1e-6)


def test_single_attempt_init_spans_steps_checkpoint_and_shutdown(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start", devices=4),
            *span(0, 10, "process_group_init"),
            *span(10, 30, "compile"),
            ev(35, "step", step=0, samples=8),
            ev(36, "step", step=1, samples=8),
            *span(37, 39, "checkpoint_save"),
            ev(39.5, "checkpoint_committed", step=1),
            ev(40, "step", step=2, samples=8),
            ev(42, "train_end"),
            ev(45, "attempt_end"),
        ],
    )
    assert res.e2e_s == pytest.approx(45)
    assert nonzero(res.buckets) == {
        "effective_training": 5,
        "process_group_init": 10,
        "compile": 20,
        "init_other": 5,
        "checkpoint_blocking": 2,
        "shutdown": 3,
    }
    assert res.ett_pct == pytest.approx(100 * 5 / 45)
    assert res.l1 == {
        "time_to_start_s": pytest.approx(35),
        "time_to_recover_s": 0,
        "failures": 0,
        "failures_by_category": {},
        "lost_progress_s": 0,
        "checkpoint_blocking_s": pytest.approx(2),
        "shutdown_s": pytest.approx(3),
    }
    assert res.devices == 4 and list(res.buckets)[: len(STANDARD_BUCKETS)] == list(STANDARD_BUCKETS)
    (attempt,) = res.attempts
    assert (attempt.steps, attempt.first_step, attempt.last_step, attempt.samples) == (3, 0, 2, 24)
    assert attempt.last_committed_step == 1 and not attempt.failed
    _sums_to_e2e(res)


def test_overlapping_spans_share_each_instant_equally(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            *span(0, 10, "compile"),
            *span(5, 15, "sharding_plan"),
            *span(5, 10, "data_loader_init"),
            ev(20, "step", step=0),
            *span(22, 26, "eval"),
            *span(24, 28, "checkpoint_save"),
            ev(30, "train_end"),
            ev(30, "attempt_end"),
        ],
    )
    # [0,5) compile; [5,10) three spans, 5/3 s each; [10,15) sharding_plan; [15,20) uncovered.
    # In step 0: [22,24) eval, [24,26) eval+save 1 s each, [26,28) save; the rest trains.
    assert nonzero(res.buckets) == pytest.approx(
        {
            "compile": 5 + 5 / 3,
            "sharding_plan": 5 / 3 + 5,
            "data_loader_init": 5 / 3,
            "init_other": 5,
            "eval": 3,
            "checkpoint_blocking": 3,
            "effective_training": 4,
        }
    )
    assert res.l1["time_to_start_s"] == pytest.approx(20)
    _sums_to_e2e(res)


def test_span_running_into_the_loop_is_split_at_the_first_step(tmp_path):
    # torch.compile compiles during step 0: the part after the first step is taken out of that step.
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            *span(2, 15, "compile"),
            ev(10, "step", step=0),
            ev(20, "train_end"),
            ev(20, "attempt_end"),
        ],
    )
    assert nonzero(res.buckets) == {"init_other": 2, "compile": 13, "effective_training": 5}
    assert res.l1["time_to_start_s"] == pytest.approx(10)


def test_failure_after_a_committed_checkpoint_loses_only_later_steps(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            ev(10, "step", step=1),
            ev(20, "step", step=2),
            ev(25, "checkpoint_committed", step=2),
            ev(30, "step", step=3),
            ev(40, "step", step=4),
            ev(45, "failure", reason="NCCL timeout", category="infra"),
            ev(50, "attempt_end"),
            ev(60, "attempt_start", attempt=1),
            *span(60, 65, "checkpoint_load", attempt=1),
            ev(70, "step", attempt=1, step=3),
            ev(80, "step", attempt=1, step=4),
            ev(90, "train_end", attempt=1),
            ev(95, "attempt_end", attempt=1),
        ],
    )
    assert nonzero(res.buckets) == {
        "effective_training": 40,
        "init_other": 15,
        "checkpoint_load": 5,
        "lost_progress": 15,
        "recovery_wait": 15,
        "shutdown": 5,
    }
    assert res.l1["time_to_start_s"] == pytest.approx(10)
    assert res.l1["time_to_recover_s"] == pytest.approx(10 + 15)
    assert (res.l1["failures"], res.l1["failures_by_category"]) == (1, {"infra": 1})
    a0, a1 = res.attempts
    assert nonzero(a0.buckets) == {"init_other": 10, "effective_training": 20, "lost_progress": 15}
    assert a0.failed and a0.failure["reason"] == "NCCL timeout" and a0.last_committed_step == 2
    assert nonzero(a1.buckets) == {
        "recovery_wait": 15,
        "checkpoint_load": 5,
        "init_other": 5,
        "effective_training": 20,
        "shutdown": 5,
    }
    assert (a1.pre_first_step_s, a1.recovery_wait_s) == (pytest.approx(10), pytest.approx(15))
    _sums_to_e2e(res)


def test_failure_without_a_committed_checkpoint_loses_every_step(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            ev(5, "step", step=0),
            *span(7, 8, "checkpoint_save"),
            ev(10, "step", step=1),
            ev(20, "failure", reason="OOM", category="user"),
            ev(30, "attempt_start", attempt=1),
            ev(35, "step", attempt=1, step=0),
            ev(40, "train_end", attempt=1),
            ev(41, "attempt_end", attempt=1),
        ],
    )
    # The save at [7,8) never committed: it is still blocking time, not lost progress.
    assert nonzero(res.buckets) == {
        "init_other": 10,
        "lost_progress": 14,
        "checkpoint_blocking": 1,
        "recovery_wait": 10,
        "effective_training": 5,
        "shutdown": 1,
    }
    assert res.l1["lost_progress_s"] == pytest.approx(14)
    _sums_to_e2e(res)


def test_preemption_with_a_scheduler_writing_job_level_events(tmp_path):
    scheduler = [
        ev(0, "attempt_start", rank=-1, devices=8),
        ev(100, "attempt_end", rank=-1),
        ev(120, "attempt_start", attempt=1, rank=-1, devices=8),
        ev(200, "attempt_end", attempt=1, rank=-1),
    ]
    trainer = [
        ev(20, "step", step=0),
        ev(30, "checkpoint_committed", step=0),
        ev(40, "step", step=1),
        ev(50, "failure", reason="SIGTERM", category="preemption"),
        ev(130, "step", attempt=1, step=1),
        ev(190, "train_end", attempt=1),
    ]
    res = run_of(tmp_path, scheduler, trainer)
    # [50,120): waiting to be rescheduled, including the 50 s the dead attempt still held its devices.
    assert nonzero(res.buckets) == {
        "init_other": 30,
        "effective_training": 80,
        "lost_progress": 10,
        "recovery_wait": 70,
        "shutdown": 10,
    }
    assert res.devices == 8 and res.e2e_s == pytest.approx(200)
    assert res.l1["failures_by_category"] == {"preemption": 1}
    assert res.l1["time_to_recover_s"] == pytest.approx(10 + 70)
    _sums_to_e2e(res)


def test_last_attempt_failing_ends_in_recovery_wait(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            ev(4, "step", step=0),
            ev(10, "failure", reason="bad data", category="user"),
            ev(15, "attempt_end"),
        ],
    )
    assert nonzero(res.buckets) == {"init_other": 4, "lost_progress": 6, "recovery_wait": 5}
    assert res.ett_pct == 0


def test_an_attempt_that_vanished_counts_as_an_unknown_failure(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            ev(1, "step", step=0),
            ev(2, "checkpoint_committed", step=0),
            ev(3, "step", step=1),
            ev(6, "step", step=2),  # then SIGKILL: no failure event
            ev(10, "attempt_start", attempt=1),
            ev(11, "step", attempt=1, step=1),
            ev(12, "train_end", attempt=1),
        ],
    )
    # Attempt 0's window ends at its last event (6): step 2 is a zero-length step there.
    assert nonzero(res.buckets) == {"init_other": 2, "effective_training": 3, "lost_progress": 3, "recovery_wait": 4}
    assert res.l1["failures_by_category"] == {"unknown": 1}
    _sums_to_e2e(res)


def test_a_commit_whose_event_the_failure_cut_off_counts_by_the_checkpoint_the_restart_loaded(tmp_path):
    def job(loaded_step):
        return [
            ev(0, "attempt_start"),
            ev(1, "step", step=0),
            ev(2, "step", step=1),
            ev(3, "checkpoint_committed", step=1),
            ev(4, "step", step=2),
            ev(5, "step", step=3),  # step 3's checkpoint became durable here; its event never came
            ev(6, "step", step=4),
            ev(8, "failure", reason="power cut", category="infra"),
            ev(10, "attempt_start", attempt=1),
            ev(11, "checkpoint_committed", attempt=1, step=loaded_step),  # what the restart loaded
            ev(12, "step", attempt=1, step=loaded_step + 1),
            ev(13, "checkpoint_committed", attempt=1, step=loaded_step + 1),
            ev(14, "step", attempt=1, step=loaded_step + 2),
            ev(15, "train_end", attempt=1),
        ]

    cut = run_of(tmp_path / "cut", job(loaded_step=3))
    first, second = cut.attempts
    assert first.last_committed_step == 3
    # only step 4 (6 to 8) ran after the checkpoint the restart loaded
    assert nonzero(cut.buckets) == {
        "init_other": 3,
        "effective_training": 5 + 3,
        "lost_progress": 2,
        "recovery_wait": 2,
    }
    # the loaded checkpoint is not one of attempt 1's saves
    assert [step for _, step in cut.timeline[1].checkpoints] == [4]
    _sums_to_e2e(cut)
    # a restart from an older checkpoint never lowers what the failed attempt committed
    older = run_of(tmp_path / "older", job(loaded_step=0))
    assert older.attempts[0].last_committed_step == 1
    assert older.buckets["lost_progress"] == pytest.approx(8 - 4)


def test_a_restart_from_a_snapshot_keeps_every_step_it_restored(tmp_path):
    """Attempt 0 committed step 1 and died in step 4; the restart restored step 3 from a per-step
    snapshot (its ``resume`` event, on rank 1 as well): only step 4's time is lost."""
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            ev(1, "step", step=0),
            ev(2, "step", step=1),
            ev(3, "checkpoint_committed", step=1),
            ev(4, "step", step=2),
            ev(5, "step", step=3),
            ev(6, "step", step=4),
            ev(6.5, "failure", reason="power cut", category="infra"),
            ev(10, "attempt_start", attempt=1),
            ev(10.5, "resume", attempt=1, step=3, source="buddy"),
            ev(10.5, "resume", attempt=1, rank=1, step=3, source="buddy"),
            ev(11, "step", attempt=1, step=4),
            ev(12, "step", attempt=1, step=5),
            ev(13, "train_end", attempt=1),
        ],
    )
    first, second = res.attempts
    assert first.last_committed_step == 3 and second.resumed == {"step": 3, "source": "buddy"}
    assert first.resumed is None
    assert res.buckets["lost_progress"] == pytest.approx(0.5)  # step 4, from 6 to the failure at 6.5
    _sums_to_e2e(res)


def test_a_commit_recorded_by_another_rank_counts(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            ev(1, "step", step=0),
            ev(2, "step", step=1),
            ev(3, "checkpoint_committed", rank=1, step=0),  # rank 0 died before recording it
            ev(4, "failure", reason="power cut", category="infra"),
        ],
    )
    assert res.attempts[0].last_committed_step == 0
    assert nonzero(res.buckets) == {"init_other": 1, "effective_training": 1, "lost_progress": 2}


def test_extra_ranks_refine_per_rank_breakdowns(tmp_path):
    rank0 = [
        ev(0, "attempt_start"),
        *span(0, 10, "compile"),
        ev(10, "step", step=0),
        ev(20, "train_end"),
        ev(20, "attempt_end"),
    ]
    rank1 = [
        ev(0, "attempt_start", rank=1),
        *span(0, 15, "compile", rank=1),
        ev(15, "step", rank=1, step=0),
        ev(20, "train_end", rank=1),
    ]
    res = run_of(tmp_path, rank0, rank1)
    assert nonzero(res.buckets) == {"compile": 10, "effective_training": 10}
    assert nonzero(res.ranks[0].buckets) == nonzero(res.buckets)
    assert nonzero(res.ranks[1].buckets) == {"compile": 15, "effective_training": 5}
    assert res.ranks[1].ett_pct == pytest.approx(25)
    assert res.to_dict()["ranks"]["1"]["e2e_s"] == pytest.approx(20)


def test_custom_and_unknown_spans(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            *span(0, 4, "warmup_batch", bucket="compile"),
            *span(4, 6, "fetch_weights"),
            ev(6, "step", step=0),
            *span(7, 8, "publish", bucket="checkpoint_save"),
            ev(10, "train_end"),
        ],
    )
    assert nonzero(res.buckets) == {"compile": 4, "fetch_weights": 2, "checkpoint_blocking": 1, "effective_training": 3}
    assert list(res.buckets)[-1] == "fetch_weights"  # unknown spans follow the standard buckets


def test_unmatched_spans_are_clipped_or_noted(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            ev(1, "begin", span="compile"),
            ev(2, "end", span="eval"),
            ev(5, "failure", reason="x", category="user"),
        ],
    )
    assert nonzero(res.buckets) == {"init_other": 1, "compile": 4}
    assert any("'eval' without 'begin'" in note for note in res.warnings)


def test_several_jobs_in_one_directory_are_separate_runs(tmp_path):
    from warmstart.metrics.events import write_events

    write_events(tmp_path / "a.jsonl", [ev(0, "attempt_start", job="a"), ev(5, "attempt_end", job="a")])
    write_events(tmp_path / "b.jsonl", [ev(0, "attempt_start", job="b"), ev(7, "attempt_end", job="b")])
    results = [compute(run) for run in load_runs([tmp_path])]
    assert sorted((r.job, round(r.e2e_s)) for r in results) == [("a", 5), ("b", 7)]


def test_torn_last_line_is_skipped_with_a_warning(tmp_path):
    from warmstart.metrics.events import write_events

    path = tmp_path / "events-r0-a0.jsonl"
    write_events(path, [ev(0, "attempt_start"), ev(2, "step", step=0), ev(4, "train_end")])
    with path.open("a") as f:
        f.write('{"ts": 1700000005.0, "job": "job-1", "att')  # the writer died mid-line
    with pytest.warns(TornLineWarning, match=r"events-r0-a0.jsonl:4: torn last line"):
        (run,) = load_runs([tmp_path])
    res = compute(run)
    assert res.e2e_s == pytest.approx(4)
    assert any("torn last line" in note for note in res.warnings)


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": 0, "event": "stepp", "step": 1}', "field 'event'"),
        ('{"ts": "soon", "job": "j", "attempt": 0, "rank": 0, "event": "train_end"}', "field 'ts'"),
        ('{"ts": 1700000001.0, "job": "j", "attempt": -1, "rank": 0, "event": "train_end"}', "'attempt' must be >= 0"),
        ('{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": 0, "event": "step"}', "missing field 'step'"),
        (
            '{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": 0, "event": "failure", "category": "oops"}',
            "field 'category'",
        ),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_line_is_an_error_naming_file_and_line(tmp_path, line, problem):
    path = tmp_path / "events.jsonl"
    good = '{"ts": 1700000000.0, "job": "j", "attempt": 0, "rank": 0, "event": "attempt_start"}'
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(EventFormatError, match=rf"events.jsonl:3: .*{problem}"):
        load_runs([tmp_path])


def test_missing_run_directory_is_an_error(tmp_path):
    with pytest.raises(EventFormatError, match="not a run directory"):
        load_runs([tmp_path / "nope"])


# -- property: the buckets always sum to end-to-end time ------------------------------------------------

_SPAN_NAMES = ["compile", "sharding_plan", "checkpoint_save", "eval", "custom"]


@st.composite
def _timelines(draw):
    events: list[dict] = []
    t = 0.0
    n_attempts = draw(st.integers(1, 4))
    for attempt in range(n_attempts):
        t += draw(st.floats(0, 50))
        ranks = draw(st.sampled_from([[0], [0, 1], [-1, 0]]))
        for rank in ranks:
            if draw(st.booleans()) or rank == -1:
                events.append(ev(t, "attempt_start", attempt, rank, devices=draw(st.integers(1, 16))))
        times = sorted(draw(st.lists(st.floats(0, 1000), min_size=0, max_size=25)))
        step = draw(st.integers(0, 5))
        for offset in times:
            rank = draw(st.sampled_from([r for r in ranks if r >= 0]))
            kind = draw(st.sampled_from(["step", "step", "begin", "end", "checkpoint_committed", "begin"]))
            fields = {}
            if kind == "step":
                step += draw(st.integers(0, 2))
                fields = {"step": step}
            elif kind == "checkpoint_committed":
                fields = {"step": draw(st.integers(0, step + 1))}
            else:
                fields = {"span": draw(st.sampled_from(_SPAN_NAMES))}
            events.append(ev(t + offset, kind, attempt, rank, **fields))
        t += (times[-1] if times else 0) + draw(st.floats(0, 10))
        ending = draw(st.sampled_from(["failure", "train_end", "vanish", "failure_and_end"]))
        if ending.startswith("failure"):
            events.append(
                ev(
                    t,
                    "failure",
                    attempt,
                    0,
                    reason="r",
                    category=draw(st.sampled_from(["infra", "preemption", "user"])),
                )
            )
        elif ending == "train_end":
            events.append(ev(t, "train_end", attempt, 0))
        if ending != "vanish":
            t += draw(st.floats(0, 30))
            events.append(ev(t, "attempt_end", attempt, draw(st.sampled_from(ranks))))
    return draw(st.permutations(events))


@given(_timelines())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_buckets_always_sum_to_end_to_end(events):
    res = compute(Run(job="job-1", run_dir="mem", events=[parse_event(e) for e in events]))
    _sums_to_e2e(res)
    if not events:
        assert res.e2e_s == 0 and res.attempts == []
        return
    assert res.e2e_s <= max(e["ts"] for e in events) - min(e["ts"] for e in events) + 1e-6
    assert all(seconds >= -1e-9 for seconds in res.buckets.values())
    assert 0 <= res.ett_pct <= 100 + 1e-9
    for rank in res.ranks.values():
        assert math.isclose(sum(rank.buckets.values()), res.e2e_s, rel_tol=1e-9, abs_tol=1e-6)
    assert res.l1["lost_progress_s"] <= res.e2e_s + 1e-6
    assert res.l1["time_to_start_s"] + res.l1["time_to_recover_s"] <= res.e2e_s + 1e-6
