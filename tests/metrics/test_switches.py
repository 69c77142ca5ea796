"""Background compiles in the ETT report: when each rank switched from eager to compiled, its step time
on either side, and that the eager steps stay training time."""

from __future__ import annotations

import json

import pytest
from _timelines import ev, nonzero, run_of, span
from click.testing import CliRunner

from warmstart.cli import cli
from warmstart.metrics.events import write_events

APPROX = {"abs": 1e-5}


def _steps(times: list[float], rank: int = 0, attempt: int = 0) -> list[dict]:
    return [ev(t, "step", attempt, rank, step=i) for i, t in enumerate(times)]


def _switch(t: float, attempt: int = 0, rank: int = 0) -> list[dict]:
    return span(t, t, "compile_switch", attempt, rank, bucket="compile")


def _rank(rank: int, eager: float, switch_at: float, compiled: float, steps: int = 8) -> list[dict]:
    """Steps of ``eager`` s until the one holding the switch (1 s of install at ``switch_at``), then of
    ``compiled`` s."""
    times, t = [], 1.0
    while t < switch_at:
        times.append(t)
        t += eager
    t = switch_at + 1.0 + compiled  # the step the switch fell in also ran the install
    while len(times) < steps:
        times.append(t)
        t += compiled
    install = [*span(switch_at, switch_at + 1.0, "compile", rank=rank)]
    return [*_steps(times, rank), *_switch(switch_at, rank=rank), *install, ev(t, "train_end", rank=rank)]


def test_each_rank_switched_with_its_steps_before_and_after(tmp_path):
    # Rank 0: eager steps of 2 s from t=1, switch at 6.5 (during step 2, which starts at 5), then 0.5 s.
    # Rank 1: 3 s eager steps, switch at 8 (during step 2, from 7).
    res = run_of(
        tmp_path,
        [ev(0, "attempt_start", devices=2), *_rank(0, 2.0, 6.5, 0.5), ev(20, "attempt_end")],
        _rank(1, 3.0, 8.0, 0.5),
    )
    r0, r1 = res.compile_switches
    assert (r0.attempt, r0.rank, r0.switches, r0.during_step) == (0, 0, 1, 2)
    assert r0.at_s == pytest.approx(6.5, **APPROX) and r0.last_at_s == pytest.approx(6.5, **APPROX)
    assert r0.eager_steps == 2 and r0.eager_step_s == pytest.approx(2.0, **APPROX)
    assert r0.compiled_steps == 4 and r0.compiled_step_s == pytest.approx(0.5, **APPROX)
    assert (r1.rank, r1.during_step, r1.eager_steps) == (1, 2, 2)
    assert r1.at_s == pytest.approx(8.0, **APPROX) and r1.eager_step_s == pytest.approx(3.0, **APPROX)
    # The eager steps are training; only the install after the switch is compile time.
    t_end = 10.5  # rank 0's train_end
    buckets = nonzero(res.buckets)
    assert buckets["compile"] == pytest.approx(1.0, **APPROX)
    assert buckets["effective_training"] == pytest.approx(res.e2e_s - 1.0 - 1.0 - (20 - t_end), **APPROX)


def test_regions_switch_one_by_one_and_steps_between_them_count_for_neither(tmp_path):
    events = [
        ev(0, "attempt_start"),
        *_steps([1, 3, 5, 7, 7.5, 8]),
        *_switch(4.0),  # in step 1 (3-5)
        *_switch(6.0),  # in step 2 (5-7)
        ev(9, "train_end"),
        ev(9, "attempt_end"),
    ]
    (s,) = run_of(tmp_path, events).compile_switches
    assert s.switches == 2 and s.at_s == pytest.approx(4.0, **APPROX) and s.last_at_s == pytest.approx(6.0, **APPROX)
    assert s.during_step == 1
    assert s.eager_steps == 1 and s.eager_step_s == pytest.approx(2.0, **APPROX)  # step 0 only
    assert s.compiled_steps == 2 and s.compiled_step_s == pytest.approx(0.5, **APPROX)  # 7-7.5, 7.5-8


def test_a_switch_before_the_first_step_and_a_run_without_switches(tmp_path):
    before = run_of(tmp_path / "a", [ev(0, "attempt_start"), *_switch(0.5), *_steps([1, 2, 3]), ev(4, "attempt_end")])
    (s,) = before.compile_switches
    assert s.during_step is None and s.eager_steps == 0 and s.eager_step_s is None and s.compiled_steps == 2
    plain = run_of(tmp_path / "b", [ev(0, "attempt_start"), *_steps([1, 2, 3]), ev(4, "attempt_end")])
    assert plain.compile_switches == [] and plain.to_dict()["compile_switches"] == []


def test_report_shows_the_switches_in_json_table_and_page(tmp_path):
    run = tmp_path / "run"
    write_events(run / "events-r0.jsonl", [ev(0, "attempt_start"), *_rank(0, 2.0, 6.5, 0.5), ev(20, "attempt_end")])
    runner = CliRunner()
    result = runner.invoke(cli, ["ett", "report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    ((switch,),) = [r["compile_switches"] for r in json.loads(result.stdout)]
    assert switch["rank"] == 0 and switch["during_step"] == 2 and switch["eager_steps"] == 2
    assert switch["eager_step_s"] == pytest.approx(2.0, **APPROX)
    assert switch["compiled_step_s"] == pytest.approx(0.5, **APPROX)

    text = " ".join(runner.invoke(cli, ["ett", "report", str(run)], terminal_width=160).stdout.split())
    assert "background compiles: when each rank switched from eager to compiled" in text
    assert "6.50 s" in text and "2.00 s (2)" in text and "500.0 ms (4)" in text and "4.00x" in text
    page = tmp_path / "report.html"
    assert runner.invoke(cli, ["ett", "report", str(run), "--html", str(page)]).exit_code == 0
    html = page.read_text()
    assert "<h3>Background compiles: when each rank switched from eager to compiled</h3>" in html
    assert "switched to compiled" in html and "rank 0 switched to compiled code during step 2" in html
    # The switch is a marker on the timeline, not a span too short to draw.
    assert "compile_switch (" not in html
