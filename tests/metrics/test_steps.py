"""Slow steps and stragglers: hand-computed timelines for each rule of warmstart.metrics.steps, and what
``warmstart ett report`` shows of them."""

from __future__ import annotations

import json
import math

import pytest
from _steps_reference import analyse_steps as reference_analyse_steps
from _timelines import ev, run_of, span
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmstart.cli import cli
from warmstart.metrics.events import parse_event, write_events
from warmstart.metrics.steps import analyse_steps, margin_s, trimmed_median

# Durations come from unix times near 1.7e9, where a float is precise to about 2e-7 s.
APPROX = {"abs": 1e-5}


def _steps(times: list[float], rank: int = 0, attempt: int = 0, first: int = 0) -> list[dict]:
    return [ev(t, "step", attempt, rank, step=first + i) for i, t in enumerate(times)]


def test_trimmed_median_drops_slow_outliers():
    # median 3, deviations 2 1 0 1 97 -> MAD 1; 100 > 3 + 3 x 1 is dropped; median of 1 2 3 4 is 2.5.
    assert trimmed_median([4, 1, 100, 3, 2]) == 2.5
    assert trimmed_median([]) is None
    assert margin_s(1.0) == 0.25 and margin_s(0.001) == 0.001 and margin_s(None) == 0.001


def test_ideal_step_slow_steps_and_the_time_they_lost(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            *span(0, 10, "compile"),
            # step 0 is warm-up (5 s); step 4 holds a 1 s checkpoint save, so it trained 1 s of its 2;
            # step 6 takes 3 s; step 7 takes 1.2 s, inside the 25% margin.
            *_steps([10, 15, 16, 17, 18, 20, 21, 24, 25.2]),
            *span(18.5, 19.5, "checkpoint_save"),
            ev(26.2, "train_end"),
            ev(27, "attempt_end"),
        ],
    )
    slow = res.slow_steps
    # Durations 5 1 1 1 1 1 3 1.2 1; without the warm-up: median 1, MAD 0, so 3 and 1.2 are outliers
    # and the ideal is the median of six 1 s steps.
    assert slow.rank == 0 and slow.measured_steps == 9
    assert slow.ideal_step_s == pytest.approx(1, **APPROX)
    assert slow.slow_above_s == pytest.approx(1.25, **APPROX)
    assert slow.slow_count == 2
    assert slow.lost_s == pytest.approx((5 - 1) + (3 - 1), **APPROX)
    assert [(s.attempt, s.step) for s in slow.slowest_steps] == [(0, 0), (0, 6)]
    assert slow.slowest_steps[1].duration_s == pytest.approx(3, **APPROX)
    assert slow.slowest_steps[1].excess_s == pytest.approx(2, **APPROX)
    assert slow.slowest_ranks == () and slow.interrupted == ()
    # A diagnostic only: the buckets are the calculator's as ever.
    assert res.buckets["effective_training"] == pytest.approx(15.2, **APPROX)


def test_failed_attempt_interrupted_step_and_steps_after_the_end(tmp_path):
    res = run_of(
        tmp_path,
        [
            ev(0, "attempt_start"),
            *_steps([1, 2, 3, 4]),
            ev(4.5, "failure", reason="x", category="infra"),
            ev(5, "step", step=4),  # after the failure: no step
            ev(10, "attempt_start", attempt=1),
            *_steps([11, 12, 15, 16], attempt=1, first=2),
            ev(17, "train_end", attempt=1),
            ev(18, "step", attempt=1, step=9),  # after train_end: shutdown
            ev(19, "attempt_end", attempt=1),
        ],
    )
    slow = res.slow_steps
    # Timed: attempt 0 steps 0-2 (1 s each); attempt 1 steps 2-5 (1, 3, 1, 1 s). Step 3 of attempt 0
    # was running at the failure, half a second in. The ideal leaves out each attempt's first step.
    assert slow.measured_steps == 7
    assert [(s.attempt, s.step, s.running_s) for s in slow.interrupted] == [(0, 3, pytest.approx(0.5, **APPROX))]
    assert slow.ideal_step_s == pytest.approx(1, **APPROX)
    assert [(s.attempt, s.step) for s in slow.slowest_steps] == [(1, 3)]
    assert slow.lost_s == pytest.approx(2, **APPROX)


def test_a_rank_lags_when_its_step_ends_after_every_other_rank(tmp_path):
    end = [ev(6, "train_end", rank=r) for r in (0, 1, 2)]
    res = run_of(
        tmp_path,
        [ev(0, "attempt_start"), *_steps([0, 1, 2, 3, 4, 5])],
        _steps([0, 1, 2.6, 3, 4, 5.3], rank=1),
        _steps([0, 1, 2, 3, 4.45, 5.4], rank=2),
        end,
    )
    slow = res.slow_steps
    # Rank 0's steps all take 1 s: ideal 1 s, margin 0.25 s. Step ends (the next step, else train_end):
    #   step 1: 2, 2.6, 2     -> rank 1 ends 0.6 s after the next latest: it lagged
    #   step 3: 4, 4, 4.45    -> rank 2 lagged by 0.45 s
    #   step 4: 5, 5.3, 5.4   -> ranks 1 and 2 were both late; rank 2 only 0.1 s after rank 1: no lag
    assert slow.ideal_step_s == pytest.approx(1, **APPROX) and slow.slow_count == 0
    (first, second) = slow.slowest_ranks
    assert (first.rank, first.lagged_steps, first.lag_s) == (1, 1, pytest.approx(0.6, **APPROX))
    assert [(lag.attempt, lag.step) for lag in first.worst] == [(0, 1)]
    assert (second.rank, second.lagged_steps, second.lag_s) == (2, 1, pytest.approx(0.45, **APPROX))
    assert [(lag.attempt, lag.step) for lag in second.worst] == [(0, 3)]


def test_ranks_with_different_steps_compare_the_steps_they_share():
    from warmstart.metrics.events import parse_event

    events = [
        parse_event(e)
        for e in [
            *_steps([0, 1, 2, 3]),
            ev(4, "train_end"),
            *_steps([0, 1.5, 2], rank=1),
            ev(2.5, "failure", rank=1, reason="x", category="user"),
        ]
    ]
    slow = analyse_steps(events)
    # The attempt failed at 2.5: rank 0's steps 0 and 1 ended (at 1 and 2), rank 1's too (1.5, 2).
    # Step 0: rank 1 ended 0.5 s after rank 0 (ideal 1 s, margin 0.25 s): a lag; step 1 ended together.
    assert [(r.rank, r.lagged_steps, round(r.lag_s, 6)) for r in slow.slowest_ranks] == [(1, 1, 0.5)]


def test_no_steps(tmp_path):
    res = run_of(tmp_path, [ev(0, "attempt_start"), *span(0, 3, "compile"), ev(4, "attempt_end")])
    slow = res.slow_steps
    assert (slow.rank, slow.measured_steps, slow.ideal_step_s, slow.slow_above_s, slow.lost_s) == (
        None,
        0,
        None,
        None,
        0.0,
    )


def _write_lagging_run(run_dir):
    write_events(
        run_dir / "events-r0.jsonl",
        [ev(0, "attempt_start", devices=2), *_steps([0, 1, 2, 3, 6, 7]), ev(8, "train_end"), ev(8, "attempt_end")],
    )
    write_events(run_dir / "events-r1.jsonl", [*_steps([0, 1, 2.5, 3, 6, 7], rank=1), ev(8, "train_end", rank=1)])


def test_report_shows_slow_steps_in_json_table_and_html(tmp_path):
    _write_lagging_run(tmp_path / "run")
    runner = CliRunner()
    result = runner.invoke(cli, ["ett", "report", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)
    slow = run["slow_steps"]
    assert {
        "ideal_step_s",
        "slow_above_s",
        "lost_s",
        "slow_count",
        "measured_steps",
        "slowest_steps",
        "slowest_ranks",
        "interrupted",
    } <= set(slow)
    # Rank 0: durations 1 1 1 3 1 1 -> ideal 1; step 3 took 3 s: 2 s lost. Rank 1 ended step 1 at 2.5.
    assert slow["ideal_step_s"] == pytest.approx(1, **APPROX) and slow["lost_s"] == pytest.approx(2, **APPROX)
    assert [(s["step"], round(s["excess_s"], 4)) for s in slow["slowest_steps"]] == [(3, 2.0)]
    assert [(r["rank"], r["lagged_steps"]) for r in slow["slowest_ranks"]] == [(1, 1)]
    assert slow["slowest_ranks"][0]["worst"][0] == {"attempt": 0, "step": 1, "lag_s": pytest.approx(0.5, **APPROX)}

    text = " ".join(runner.invoke(cli, ["ett", "report", str(tmp_path / "run")]).stdout.split())
    assert "slow steps: ideal step" in text and "1 slower than" in text and "lost 2.00 s" in text
    assert "slowest steps" in text and "stragglers" in text
    page = tmp_path / "report.html"
    assert runner.invoke(cli, ["ett", "report", str(tmp_path / "run"), "--html", str(page)]).exit_code == 0
    html = page.read_text()
    assert "<h3>Slow steps</h3>" in html and "<h3>Stragglers</h3>" in html


@st.composite
def _step_timelines(draw) -> list[dict]:
    """Steps of a few ranks over a few attempts, with jitter, stalls, repeated and skipped step numbers,
    spans inside steps, failures and train_ends, in any order."""
    events: list[dict] = []
    ranks = draw(st.lists(st.integers(-1, 3), min_size=1, max_size=4, unique=True))
    for attempt in range(draw(st.integers(1, 3))):
        base = attempt * 1000.0
        for rank in ranks:
            t, step = base + draw(st.floats(0, 2)), draw(st.integers(0, 5))
            for _ in range(draw(st.integers(0, 25))):
                events.append(ev(t, "step", attempt, rank, step=step))
                if draw(st.integers(0, 6)) == 0:
                    begin = t + draw(st.floats(0, 2))
                    events.extend(
                        span(
                            begin,
                            begin + draw(st.floats(0, 3)),
                            draw(st.sampled_from(["eval", "save"])),
                            attempt,
                            draw(st.sampled_from([rank, -1])),
                        )
                    )
                t += draw(st.sampled_from([1.0, 1.0, 1.1, 0.9, 3.0, 0.0]))
                step += draw(st.sampled_from([1, 1, 1, 0, 2]))
            if draw(st.booleans()):
                events.append(ev(t + draw(st.floats(-5, 2)), "train_end", attempt, rank))
        if draw(st.booleans()):
            events.append(ev(base + draw(st.floats(0, 40)), "failure", attempt, ranks[0], reason="x", category="infra"))
        if draw(st.booleans()):
            events.append(ev(base + draw(st.floats(0, 40)), "begin", attempt, -1, span="compile"))  # never ends
    return draw(st.permutations(events))


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_close, a, b))
    return a == b and type(a) is type(b)


@given(_step_timelines(), st.sampled_from([None, 0, 1, -1]))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_agrees_with_the_plain_reference(events, rank):
    parsed = [parse_event(e) for e in events]
    got, want = analyse_steps(parsed, rank).to_dict(), reference_analyse_steps(parsed, rank).to_dict()
    assert _close(got, want), (got, want)
