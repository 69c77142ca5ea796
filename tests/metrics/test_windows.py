"""Time windows (``--since``, ``--until``, ``--exclude``, ``--every``): hand-computed timelines cut through
spans, checkpoint saves, failures and recovery waits; the CLI's ``--json``, tables and usage errors;
fleet windows; the window chart in a real Chromium; and a property test that windows add up."""

from __future__ import annotations

import json
import math

import pytest
from _timelines import T0, ev, nonzero, span
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_calculator import _timelines as random_timelines
from test_html_report import CHROMIUM, _load_in_chromium

from warmstart.cli import cli
from warmstart.metrics.calculator import Run, compute, load_runs
from warmstart.metrics.events import parse_event, write_events
from warmstart.metrics.report_html import render_html
from warmstart.metrics.windows import (
    MAX_WINDOWS,
    FleetWindows,
    TimeFilter,
    apply,
    parse_duration,
    parse_range,
    parse_time,
    restrict,
    run_windows,
)


def _write_job(run_dir, job="job-1", devices=2, with_rank_1=False):
    """Two attempts, every kind of stretch (hand-computed buckets in the tests below):

    attempt 0: process_group_init [0,8) and compile [4,12) overlap on [4,8); init_other [12,15);
    step 0 [15,25) effective; step 1 [25,35) effective but for checkpoint_save [27,31); checkpoint of
    step 1 committed at 32; steps 2 [35,45) and 3 [45,50) lost to the failure at 50 (the attempt still
    held its hardware until 52). recovery_wait [50,60). attempt 1: checkpoint_load [60,66),
    init_other [66,70), effective [70,90), shutdown [90,94).
    """
    write_events(
        run_dir / "events-r0.jsonl",
        [
            ev(0, "attempt_start", job=job, devices=devices),
            *span(0, 8, "process_group_init", job=job),
            *span(4, 12, "compile", job=job),
            ev(15, "step", job=job, step=0),
            ev(25, "step", job=job, step=1),
            *span(27, 31, "checkpoint_save", job=job),
            ev(32, "checkpoint_committed", job=job, step=1),
            ev(35, "step", job=job, step=2),
            ev(45, "step", job=job, step=3),
            ev(50, "failure", job=job, reason="NCCL timeout", category="infra"),
            ev(52, "attempt_end", job=job),
            ev(60, "attempt_start", attempt=1, job=job, devices=devices),
            *span(60, 66, "checkpoint_load", attempt=1, job=job),
            ev(70, "step", attempt=1, job=job, step=2),
            ev(80, "step", attempt=1, job=job, step=3),
            ev(90, "train_end", attempt=1, job=job),
            ev(94, "attempt_end", attempt=1, job=job),
        ],
    )
    if with_rank_1:  # one step per attempt and a longer save: effective [15,50) less [27,33), [70,90)
        write_events(
            run_dir / "events-r1.jsonl",
            [
                ev(15, "step", rank=1, job=job, step=0),
                *span(27, 33, "checkpoint_save", rank=1, job=job),
                ev(70, "step", attempt=1, rank=1, job=job, step=2),
            ],
        )


def _job(tmp_path, **kwargs):
    _write_job(tmp_path, **kwargs)
    (run,) = load_runs([tmp_path])
    return compute(run, segments=True)


FULL = {
    "process_group_init": 6,
    "compile": 6,
    "init_other": 7,
    "effective_training": 36,
    "checkpoint_blocking": 4,
    "lost_progress": 15,
    "recovery_wait": 10,
    "checkpoint_load": 6,
    "shutdown": 4,
}


def _t(seconds: float) -> float:
    return T0 + seconds


def _sums(result) -> None:
    assert math.isclose(sum(result.buckets.values()), result.e2e_s, abs_tol=1e-6)
    assert math.isclose(sum(a.e2e_s for a in result.attempts), result.e2e_s, abs_tol=1e-6)


# -- restricting the total -----------------------------------------------------------------------------


def test_the_hand_computed_timeline_and_no_filter_change_nothing(tmp_path):
    res = _job(tmp_path)
    assert nonzero(res.buckets) == FULL and res.e2e_s == pytest.approx(94)
    same = restrict(res, TimeFilter())
    assert nonzero(same.buckets) == FULL and same.e2e_s == pytest.approx(94)
    assert same.l1 == res.l1  # the same sums, in the same order: exactly equal
    assert [nonzero(a.buckets) for a in same.attempts] == [nonzero(a.buckets) for a in res.attempts]


def test_since_until_cut_through_overlapping_spans_and_the_recovery_wait(tmp_path):
    res = restrict(_job(tmp_path, with_rank_1=True), TimeFilter(since=_t(6), until=_t(55)))
    # [6,8): process_group_init and compile share each instant, 1 s each; [8,12) compile; [12,15) other;
    # effective 10 + 6, checkpoint_save 4, lost 15; recovery [50,55) only: 49 s.
    assert nonzero(res.buckets) == {
        "process_group_init": 1,
        "compile": 5,
        "init_other": 3,
        "effective_training": 16,
        "checkpoint_blocking": 4,
        "lost_progress": 15,
        "recovery_wait": 5,
    }
    assert res.e2e_s == pytest.approx(49) and res.ett_pct == pytest.approx(100 * 16 / 49)
    assert (res.start_ts, res.end_ts) == (_t(6), _t(55))
    assert res.l1["time_to_start_s"] == pytest.approx(9)  # the part of [0,15) after 6
    assert res.l1["time_to_recover_s"] == pytest.approx(5)
    assert (res.l1["failures"], res.l1["failures_by_category"]) == (1, {"infra": 1})
    a0, a1 = res.attempts  # attempt 1 is kept for the recovery wait before it
    assert nonzero(a0.buckets) == {
        "process_group_init": 1,
        "compile": 5,
        "init_other": 3,
        "effective_training": 16,
        "checkpoint_blocking": 4,
        "lost_progress": 15,
    }
    assert nonzero(a1.buckets) == {"recovery_wait": 5} and a1.recovery_wait_s == pytest.approx(5)
    assert a0.pre_first_step_s == pytest.approx(9) and a1.pre_first_step_s == 0
    # rank 1: other [6,15); effective [15,50) less its own save [27,33); recovery [50,55).
    assert nonzero(res.ranks[1].buckets) == {
        "init_other": 9,
        "effective_training": 29,
        "checkpoint_blocking": 6,
        "recovery_wait": 5,
    }
    assert res.ranks[1].ett_pct == pytest.approx(100 * 29 / 49)
    assert nonzero(res.ranks[0].buckets) == nonzero(res.buckets)
    _sums(res)


def test_a_window_cutting_a_checkpoint_save_attributes_only_its_overlap(tmp_path):
    res = restrict(_job(tmp_path), TimeFilter(since=_t(29), until=_t(33)))
    # step 1's save runs [27,31): 2 s of it here, then 2 s of training.
    assert nonzero(res.buckets) == {"checkpoint_blocking": 2, "effective_training": 2}
    assert res.l1["failures"] == 0 and res.l1["time_to_start_s"] == 0
    assert [a.attempt for a in res.attempts] == [0]


def test_excluded_ranges_count_in_no_bucket_and_not_in_end_to_end(tmp_path):
    time = TimeFilter(exclude=((_t(28), _t(33)), (_t(55), _t(65))))
    res = restrict(_job(tmp_path), time)
    # Out: [28,31) of the save and [31,33) of training; [55,60) of the wait and [60,65) of the load.
    assert nonzero(res.buckets) == {
        **FULL,
        "effective_training": 34,
        "checkpoint_blocking": 1,
        "recovery_wait": 5,
        "checkpoint_load": 1,
    }
    assert res.e2e_s == pytest.approx(94 - 5 - 10) and res.ett_pct == pytest.approx(100 * 34 / 79)
    a0, a1 = res.attempts
    assert a0.e2e_s == pytest.approx(45) and a1.e2e_s == pytest.approx(34)
    assert res.l1["time_to_recover_s"] == pytest.approx(1 + 4 + 5)
    assert res.l1["failures"] == 1
    _sums(res)


def test_a_failure_in_an_excluded_range_is_not_counted(tmp_path):
    res = restrict(_job(tmp_path), TimeFilter(exclude=((_t(49), _t(51)),)))
    assert res.l1["failures"] == 0 and res.e2e_s == pytest.approx(92)
    assert res.attempts[0].failed  # the attempt still ended by it: its later steps stay lost
    assert res.buckets["lost_progress"] == pytest.approx(14)


def test_a_filter_outside_the_job_leaves_nothing(tmp_path):
    res = apply(_job(tmp_path), TimeFilter(since=_t(200), every=60))
    assert res.e2e_s == 0 and res.ett_pct is None and res.attempts == [] and res.windows == []
    assert res.timeline == [] and res.l1["failures"] == 0


def test_the_timeline_chart_is_clipped_too(tmp_path):
    res = restrict(_job(tmp_path), TimeFilter(since=_t(29), until=_t(55)))
    (tl0, tl1) = res.timeline
    assert (tl0.start, tl0.end, tl0.first_step) == (_t(29), _t(50), _t(29))
    assert [(s.name, s.start, s.end) for s in tl0.spans] == [("checkpoint_save", _t(29), _t(31))]
    assert [n for _, n in tl0.steps] == [2, 3] and tl0.failure["ts"] == _t(50)
    assert tl1.recovery_before == (_t(50), _t(55)) and tl1.spans == []


def test_restrict_needs_segments(tmp_path):
    _write_job(tmp_path)
    (run,) = load_runs([tmp_path])
    with pytest.raises(ValueError, match="segments=True"):
        restrict(compute(run), TimeFilter(since=_t(10)))


# -- windows -------------------------------------------------------------------------------------------


def _windows(result):
    return [(w.since - T0, w.until - T0, nonzero(w.buckets), w.failures) for w in result.windows]


def test_windows_of_25_s_cut_a_save_a_failure_and_the_recovery_wait(tmp_path):
    res = apply(_job(tmp_path), TimeFilter(every=25))
    assert _windows(res) == [
        (0, 25, {"process_group_init": 6, "compile": 6, "init_other": 3, "effective_training": 10}, 0),
        (25, 50, {"effective_training": 6, "checkpoint_blocking": 4, "lost_progress": 15}, 0),
        # The failure at 50 opens this window; its recovery wait [50,60) runs into it.
        (50, 75, {"recovery_wait": 10, "checkpoint_load": 6, "init_other": 4, "effective_training": 5}, 1),
        (75, 94, {"effective_training": 15, "shutdown": 4}, 0),  # the last one ends with the job
    ]
    assert [w.ett_pct for w in res.windows] == pytest.approx([40, 24, 20, 100 * 15 / 19])
    assert nonzero(res.buckets) == FULL  # --every alone restricts nothing


def test_windows_leave_out_excluded_time_and_start_at_since(tmp_path):
    time = TimeFilter(since=_t(-60), exclude=((_t(28), _t(30)),), every=30)
    res = apply(_job(tmp_path), time)
    rows = _windows(res)
    assert rows[:2] == [(-60, -30, {}, 0), (-30, 0, {}, 0)]  # before the job: nothing counted
    assert [w.ett_pct for w in res.windows[:2]] == [None, None]
    # [0,30) less [28,30): the save's [27,28) only.
    assert rows[2] == (
        0,
        30,
        {"process_group_init": 6, "compile": 6, "init_other": 3, "effective_training": 12, "checkpoint_blocking": 1},
        0,
    )
    assert res.windows[2].e2e_s == pytest.approx(28) and res.windows[2].ett_pct == pytest.approx(100 * 12 / 28)
    assert sum(w.e2e_s for w in res.windows) == pytest.approx(res.e2e_s) == pytest.approx(92)


def test_too_many_windows_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="more than"):
        run_windows(_job(tmp_path), TimeFilter(every=94 / (MAX_WINDOWS + 1)))


# -- fleet ---------------------------------------------------------------------------------------------


def _write_fleet(tmp_path):
    _write_job(tmp_path / "a", job="a", devices=2)
    write_events(
        tmp_path / "b" / "events.jsonl",
        [  # other [30,40), effective [40,90), 3 devices
            ev(30, "attempt_start", job="b", devices=3),
            ev(40, "step", job="b", step=0),
            ev(90, "train_end", job="b"),
            ev(90, "attempt_end", job="b"),
        ],
    )


def test_fleet_windows_weight_each_job_by_its_devices(tmp_path):
    _write_fleet(tmp_path)
    time = TimeFilter(since=_t(0), every=30)
    series = FleetWindows(time)
    for run in load_runs([tmp_path / "a", tmp_path / "b"]):
        series.add(compute(run, segments=True))
    rows = [
        (w.since - T0, w.until - T0, w.jobs, w.device_seconds, w.effective_device_seconds, w.failures)
        for w in series.windows()
    ]
    # a: [0,30) 30 s with 12 effective; [30,60) 4 effective; [60,90) 20; [90,94) shutdown. b: 20, 30 effective.
    assert rows == [
        (0, 30, 1, 60, 24, 0),
        (30, 60, 2, 60 + 90, 8 + 60, 1),
        (60, 90, 2, 60 + 90, 40 + 90, 0),
        (90, 120, 1, 8, 0, 0),
    ]
    assert [w.ett_pct for w in series.windows()] == pytest.approx([40, 100 * 68 / 150, 100 * 130 / 150, 0])


def test_fleet_windows_line_up_on_the_epoch_without_since(tmp_path):
    _write_fleet(tmp_path)
    series = FleetWindows(TimeFilter(every=30))
    for run in load_runs([tmp_path / "a"]):
        series.add(compute(run, segments=True))
    windows = series.windows()
    assert all(w.since % 30 == 0 for w in windows)
    assert windows[0].since == T0 - 20 and windows[-1].until == T0 + 100  # T0 is 20 s past a multiple of 30
    assert sum(w.device_seconds for w in windows) == pytest.approx(94 * 2)


# -- the command line ----------------------------------------------------------------------------------


def _invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_report_every_json_adds_windows_and_keeps_the_total_keys(tmp_path):
    _write_job(tmp_path)
    result = _invoke("ett", "report", tmp_path, "--every", "30s", "--json")
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)
    assert {"job", "e2e_s", "ett_pct", "buckets", "l1", "attempts", "ranks"} <= set(run)
    assert run["e2e_s"] == pytest.approx(94) and run["ett_pct"] == pytest.approx(100 * 36 / 94)
    windows = run["windows"]
    assert [(w["since"] - T0, w["until"] - T0) for w in windows] == [(0, 30), (30, 60), (60, 90), (90, 94)]
    # [0,30): the save's [27,30) is cut off at 30, [30,31) opens the next window.
    assert [nonzero(w["buckets"]) for w in windows] == [
        {"process_group_init": 6, "compile": 6, "init_other": 3, "effective_training": 12, "checkpoint_blocking": 3},
        {"effective_training": 4, "checkpoint_blocking": 1, "lost_progress": 15, "recovery_wait": 10},
        {"checkpoint_load": 6, "init_other": 4, "effective_training": 20},
        {"shutdown": 4},
    ]
    assert [w["ett_pct"] for w in windows] == pytest.approx([40, 100 * 4 / 30, 100 * 20 / 30, 0])
    assert [w["e2e_s"] for w in windows] == pytest.approx([30, 30, 30, 4])
    assert [w["failures"] for w in windows] == [0, 1, 0, 0]


def test_report_restricted_json_and_iso_times(tmp_path):
    _write_job(tmp_path)
    since = "2023-11-14T22:13:26+00:00"  # T0 + 6
    result = _invoke("ett", "report", tmp_path, "--since", since, "--until", _t(55), "--json")
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)
    assert "windows" not in run  # only --every adds them
    assert run["e2e_s"] == pytest.approx(49) and run["buckets"]["effective_training"] == pytest.approx(16)
    assert run["l1"]["time_to_start_s"] == pytest.approx(9)
    assert math.isclose(sum(run["buckets"].values()), run["e2e_s"], abs_tol=1e-6)


def test_report_exclude_is_repeatable(tmp_path):
    _write_job(tmp_path)
    result = _invoke(
        "ett", "report", tmp_path, "--exclude", f"{_t(28)}..{_t(33)}", "--exclude", f"{_t(55)}..{_t(65)}", "--json"
    )
    (run,) = json.loads(result.stdout)
    assert run["e2e_s"] == pytest.approx(79) and run["buckets"]["effective_training"] == pytest.approx(34)


def test_report_table_lists_the_windows(tmp_path):
    _write_job(tmp_path)
    result = _invoke("ett", "report", tmp_path, "--every", "25s")
    assert result.exit_code == 0
    table = result.stdout.split("windows (")[1]
    assert table.count("25.00 s") >= 3 and "19.00 s" in table
    for ett in ("40.0", "24.0", "20.0", "78.9"):
        assert ett in table
    assert "lost_progress 60.0%" in table  # the largest other bucket of [25,50)


def test_fleet_json_and_table_with_windows(tmp_path):
    _write_fleet(tmp_path)
    result = _invoke("ett", "fleet", tmp_path / "a", tmp_path / "b", "--since", _t(0), "--every", "30s", "--json")
    assert result.exit_code == 0, result.output
    fleet = json.loads(result.stdout)
    assert fleet["device_seconds"] == pytest.approx(94 * 2 + 60 * 3)
    assert fleet["ett_pct"] == pytest.approx(100 * (36 * 2 + 50 * 3) / (94 * 2 + 60 * 3))
    assert [w["ett_pct"] for w in fleet["windows"]] == pytest.approx([40, 100 * 68 / 150, 100 * 130 / 150, 0])
    assert [w["jobs"] for w in fleet["windows"]] == [1, 2, 2, 1]
    restricted = json.loads(_invoke("ett", "fleet", tmp_path / "a", tmp_path / "b", "--until", _t(60), "--json").stdout)
    # a: its first 60 s with 16 effective; b: [30,60) with 20 effective.
    assert restricted["device_seconds"] == pytest.approx(60 * 2 + 30 * 3)
    assert restricted["effective_device_seconds"] == pytest.approx(16 * 2 + 20 * 3)
    assert "windows" not in restricted
    text = _invoke("ett", "fleet", tmp_path, "--since", _t(0), "--every", "30s").stdout
    assert "device-hours" in text and "45.3" in text and "86.7" in text


@pytest.mark.parametrize(
    "args, named, accepted",
    [
        (["--since", "yesterday"], "'--since'", "ISO-8601"),
        (["--until", "2024-13-01"], "'--until'", "epoch seconds"),
        (["--every", "5 minutes"], "'--every'", "15m"),
        (["--every", "0s"], "'--every'", "positive duration"),
        (["--exclude", "1700000000"], "'--exclude'", "T1..T2"),
        (["--exclude", "1700000050..1700000010"], "'--exclude'", "T1 before T2"),
        (["--exclude", "then..1700000010"], "'--exclude'", "ISO-8601"),
        (["--since", "1700000050", "--until", "1700000010"], "--since", "non-empty interval"),
        (["--every", "0.001s"], "'--every'", "longer duration"),
    ],
)
@pytest.mark.parametrize("command", ["report", "fleet"])
def test_bad_window_options_are_usage_errors(tmp_path, command, args, named, accepted):
    _write_job(tmp_path)
    result = CliRunner().invoke(cli, ["ett", command, str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    error = [line for line in result.stderr.splitlines() if line.startswith("warmstart: ")]
    assert len(error) == 1 and named in error[0] and accepted in error[0], result.stderr
    assert "Traceback" not in result.output


def test_parsers():
    assert parse_time("1700000000") == 1_700_000_000 and parse_time(" 1700000000.5 ") == 1_700_000_000.5
    assert parse_time("2023-11-14T22:13:20Z") == T0 == parse_time("2023-11-15T00:13:20+02:00")
    assert [parse_duration(d) for d in ("30s", "15m", "1h", "1d", "1h30m", "90", "1.5h")] == [
        30,
        900,
        3600,
        86400,
        5400,
        90,
        5400,
    ]
    assert parse_range("1700000000..2023-11-14T22:14:00Z") == (T0, T0 + 40)
    for bad in ("", "nan", "inf", "12:00"):
        with pytest.raises(ValueError, match="not a time"):
            parse_time(bad)
    for bad in ("", "-5s", "1x", "h", "1h 30m", "0"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)
    with pytest.raises(ValueError):
        TimeFilter(since=10, until=10)


# -- HTML ----------------------------------------------------------------------------------------------


def test_html_page_has_the_window_chart(tmp_path):
    _write_job(tmp_path / "run")
    page = tmp_path / "report.html"
    result = _invoke("ett", "report", tmp_path / "run", "--every", "30s", "--html", page)
    assert result.exit_code == 0
    text = page.read_text()
    assert text.count('id="windows-0"') == 1 and "ETT% per window" in text
    without = tmp_path / "plain.html"
    _invoke("ett", "report", tmp_path / "run", "--html", without)
    assert 'id="windows-' not in without.read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it)")
def test_window_chart_renders_in_chromium(tmp_path):
    res = apply(_job(tmp_path / "run"), TimeFilter(every=25, exclude=((_t(55), _t(65)),)))
    page = tmp_path / "report.html"
    page.write_text(render_html([res]))
    plots, problems = _load_in_chromium(page, tmp_path)
    assert problems == []
    assert "js-plotly-plot" in plots.div_classes["windows-0"]
    assert plots.main_svgs >= 6  # three figures, each with its main and info layers


# -- property: windows add up to the total -------------------------------------------------------------


@given(random_timelines(), st.floats(1, 400), st.floats(-50, 500), st.floats(1, 400))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_windows_and_restrictions_add_up(events, every, cut, cut_len):
    res = compute(Run(job="job-1", run_dir="mem", events=[parse_event(e) for e in events]), segments=True)
    whole = apply(res, TimeFilter(every=every))
    for name, seconds in res.buckets.items():  # the windows tile the job
        assert sum(w.buckets[name] for w in whole.windows) == pytest.approx(seconds, abs=1e-6)
    if res.e2e_s > 0:  # a job of no time has no windows
        assert sum(w.failures for w in whole.windows) == res.l1["failures"]
    # A cut splits the total in two that add up, bucket by bucket and for every rank.
    cut_at, cut_end = res.start_ts + cut, res.start_ts + cut + cut_len
    before = restrict(res, TimeFilter(until=cut_at)) if cut_at > res.start_ts else None
    after = restrict(res, TimeFilter(since=cut_at))
    hole = restrict(res, TimeFilter(exclude=((cut_at, cut_end),)))
    inside = restrict(res, TimeFilter(since=cut_at, until=cut_end))
    for name, seconds in res.buckets.items():
        parts = after.buckets[name] + (before.buckets[name] if before else 0.0)
        assert parts == pytest.approx(seconds, abs=1e-6)
        assert hole.buckets[name] + inside.buckets[name] == pytest.approx(seconds, abs=1e-6)
    for rank, data in res.ranks.items():
        parts = after.ranks[rank].e2e_s + (before.ranks[rank].e2e_s if before else 0.0)
        assert parts == pytest.approx(data.e2e_s, abs=1e-6)
    for part in (after, hole, inside):
        _sums(part)
        assert (part.ett_pct is None) == (part.e2e_s == 0)  # no counted time, no ETT%
        assert part.ett_pct is None or 0 <= part.ett_pct <= 100 + 1e-9
        assert part.l1["time_to_start_s"] + part.l1["time_to_recover_s"] <= part.e2e_s + 1e-6
