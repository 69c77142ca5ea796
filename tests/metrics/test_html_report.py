"""The HTML report in a real headless Chromium: it renders, its charts are drawn, the console is clean."""

from __future__ import annotations

import html
from pathlib import Path

import pytest
from _chromium import CHROMIUM, assert_titles_clear, load, overlaps
from _timelines import ev, run_of, span

from warmstart.metrics.calculator import compute, load_runs
from warmstart.metrics.report_html import render_html
from warmstart.metrics.windows import TimeFilter, apply

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it)")


def _load_in_chromium(page, tmp_path):
    plots, problems, _ = load(page, tmp_path)
    return plots, problems


def _run_with_everything(run_dir: Path):
    return run_of(
        run_dir,
        [
            ev(0, "attempt_start", devices=8),
            *span(0, 4, "process_group_init"),
            *span(2, 9, "compile"),
            *span(3, 6, "sharding_plan"),
            ev(10, "step", step=0),
            ev(11, "step", step=1),
            *span(11.5, 12, "checkpoint_save"),
            ev(12.5, "checkpoint_committed", step=1),
            ev(13, "step", step=2),
            *span(13.5, 14, "eval"),
            ev(15, "step", step=3),
            ev(16, "failure", reason="NCCL <timeout> & co", category="infra"),
            ev(30, "attempt_start", attempt=1, devices=8),
            *span(30, 33, "checkpoint_load", attempt=1),
            ev(35, "step", attempt=1, step=2),
            ev(36, "step", attempt=1, step=3),
            ev(37, "train_end", attempt=1),
            ev(40, "attempt_end", attempt=1),
        ],
    )


def test_report_page_renders_its_charts_without_console_errors(tmp_path):
    result = _run_with_everything(tmp_path / "run")
    page = tmp_path / "report.html"
    page.write_text(render_html([result]))
    plots, problems = _load_in_chromium(page, tmp_path)
    assert problems == []
    for div in ("timeline-0", "breakdown-0"):
        assert "js-plotly-plot" in plots.div_classes[div]  # plotly.js ran on it
    assert plots.main_svgs >= 4  # two figures, each with its main and info layers
    assert plots.bar_traces >= 10  # phases, spans and the stacked breakdown were drawn
    assert plots.points >= 3  # step, checkpoint and failure markers


def test_console_errors_are_detected(tmp_path):
    # The check above must be able to fail: a page that logs an error is caught.
    page = tmp_path / "broken.html"
    page.write_text("<html><head></head><body><script>console.error('bad'); missingFn();</script></body></html>")
    _, problems = _load_in_chromium(page, tmp_path)
    assert any("bad" in line for line in problems)
    assert any("missingFn" in line for line in problems)


@pytest.mark.parametrize("width", [1400, 800])
def test_report_titles_are_clear_of_the_toolbar(tmp_path, width):
    _run_with_everything(tmp_path / "run")
    windowed = apply(compute(load_runs([tmp_path / "run"])[0], segments=True), TimeFilter(every=5))
    page = tmp_path / "report.html"
    page.write_text(render_html([windowed]))
    _, problems, boxes = load(page, tmp_path, width=width)
    assert problems == []
    assert_titles_clear(boxes, ["breakdown-0", "windows-0", "timeline-0"])


def test_overlap_is_detected():
    # The check above must be able to fail: a title under the mode bar overlaps it.
    assert overlaps([600, 10, 1000, 30], [900, 2, 1200, 28])
    assert not overlaps([600, 40, 1000, 60], [900, 2, 1200, 28])


# -- the layout of each chart, as Chromium draws it ------------------------------------------------------


def _legend_just_below_axis_title(box):
    """The legend starts under the x-axis title, and close to it."""
    assert box["legend"] and box["xtitle"], box
    assert not overlaps(box["legend"], box["xtitle"]), box
    assert 0 <= box["legend"][1] - box["xtitle"][3] < 30, box


def _one_lane(run_dir: Path):
    return run_of(
        run_dir,
        [
            ev(0, "attempt_start"),
            ev(2, "step", step=0),
            ev(3, "step", step=1),
            ev(30, "train_end"),
            ev(31, "attempt_end"),
        ],
    )


def _many_spans(run_dir: Path):
    """Two attempts, each with the start-up spans of the reference job, a few of them too short to see."""
    files = []
    for attempt, t in ((0, 0.0), (1, 60.0)):
        events = [
            ev(t, "attempt_start", attempt),
            *span(t, t + 8, "imports", attempt),
            *span(t + 8, t + 30, "compile", attempt),
            *span(t + 8.2, t + 8.201, "cache_fetch", attempt),
            *span(t + 8.3, t + 8.8, "sharding_plan", attempt),
            *span(t + 8.5, t + 8.501, "optimizer_init", attempt),
        ]
        events += [ev(t + 30 + i, "step", attempt, step=i) for i in range(20)]
        events.append(
            ev(t + 50, "failure", attempt, reason="injected", category="infra")
            if attempt == 0
            else ev(t + 50, "train_end", attempt)
        )
        files.append(events)
    return run_of(run_dir, *files)


@pytest.mark.parametrize("make", [_one_lane, _many_spans])
@pytest.mark.parametrize("width", [1400, 800])
def test_timeline_legend_sits_just_below_the_axis_title(tmp_path, make, width):
    page = tmp_path / "report.html"
    page.write_text(render_html([make(tmp_path / "run")]))
    _, problems, boxes = load(page, tmp_path, width=width)
    assert problems == []
    (timeline,) = [b for b in boxes if b["id"] == "timeline-0"]
    _legend_just_below_axis_title(timeline)


def test_span_lanes_are_one_per_name_and_never_empty(tmp_path):
    from warmstart.metrics.report_html import _timeline_figure

    page = render_html([_many_spans(tmp_path / "run")])
    fig = _timeline_figure(_many_spans(tmp_path / "again"))
    lanes = list(fig.layout.yaxis.categoryarray)
    # Both attempts' spans share a lane per name; spans of a millisecond draw nothing, so they are
    # named under the chart instead of holding an empty lane.
    assert sorted(lanes) == ["attempt 0", "attempt 1", "compile", "imports", "sharding_plan"]
    drawn = {lane for trace in fig.data if trace.type == "bar" for lane in trace.y}
    assert drawn == set(lanes)
    assert "Spans too short to draw in the timeline: cache_fetch (2 x, 2.0 ms in all), optimizer_init" in page


def test_markers_are_thinned_where_they_would_merge(tmp_path):
    from warmstart.metrics.report_html import _MAX_MARKERS, _timeline_figure

    events = [ev(0, "attempt_start")]
    for i in range(1000):
        events.append(ev(1 + i, "step", step=i))
        if i % 2:
            events += [*span(1.5 + i, 1.55 + i, "checkpoint_save"), ev(1.6 + i, "checkpoint_committed", step=i)]
    events += [ev(1001, "train_end"), ev(1002, "attempt_end")]
    fig = _timeline_figure(run_of(tmp_path, events))
    markers = {trace.name: len(trace.x) for trace in fig.data if trace.type == "scatter"}
    assert markers == {"steps (1 in 17)": 59, "checkpoint committed (1 in 9)": 56}
    assert all(n <= _MAX_MARKERS for n in markers.values())


@pytest.mark.parametrize("ett, grade", [(25, "poor"), (60, "fair"), (90, "good")])
def test_headline_colour_follows_the_figure(tmp_path, ett, grade):
    res = run_of(tmp_path, [ev(0, "attempt_start"), ev(100 - ett, "step", step=0), ev(100, "train_end")])
    assert res.ett_pct == pytest.approx(ett)
    assert f'<span class="ett {grade}">{ett:.1f}%</span>' in render_html([res])


def test_windows_chart_counts_seconds_since_the_start_like_the_timeline(tmp_path):
    from warmstart.metrics.report_html import _windows_figure

    windowed = apply(
        compute(load_runs([_run_with_everything(tmp_path / "run").run_dir])[0], segments=True), TimeFilter(every=5)
    )
    fig = _windows_figure(windowed.windows, t0=windowed.start_ts)
    assert fig.layout.xaxis.type != "date"
    assert fig.layout.xaxis.title.text == "seconds since the first attempt_start"
    assert [round(x, 6) for x in fig.data[-1].x] == [2.5 + 5 * k for k in range(8)]


# -- four ranks, one straggling: the slow steps, the ranks and their layout ---------------------------------


def _four_ranks(run_dir: Path, *, slow: bool):
    """Four ranks stepping every 0.6 s; with ``slow``, a 2.5 s step every 50 and rank 3 late by
    0.3 s every 10th step."""
    files = []
    for rank in range(4):
        events = [ev(0, "attempt_start", rank=rank, devices=4), *span(0, 3, "compile", rank=rank)]
        t = 4.0
        for step in range(120):
            late = 0.3 if slow and rank == 3 and step % 10 == 0 else 0.0
            events.append(ev(t + late, "step", rank=rank, step=step))
            t += 2.5 if slow and step % 50 == 7 else 0.6
        files.append([*events, ev(t, "train_end", rank=rank), ev(t + 1, "attempt_end", rank=rank)])
    return run_of(run_dir, *files)


def test_nothing_slow_shows_no_empty_table_and_says_none(tmp_path):
    steady = _four_ranks(tmp_path / "run", slow=False)
    page = render_html([steady])
    slow = page[page.index('<div class="slow">') :].split("</div>", 1)[0]
    assert "none slower than" in slow and "<table" not in slow and " 0 slower than" not in slow


def test_ranks_what_and_summed_lag_read_as_the_text_does(tmp_path):
    from warmstart.metrics.formatting import LAG_NOTE

    result = _four_ranks(tmp_path / "run", slow=True)
    page = tmp_path / "report.html"
    page.write_text(render_html([result]))
    plots, problems, boxes = load(page, tmp_path)
    assert problems == []
    text = page.read_text()
    assert "<h3>Ranks</h3>" in text  # the text report's per-rank table has its counterpart
    ranks = text[text.index("<h3>Ranks</h3>") :].split("</table>", 1)[0]
    assert ranks.count("<tr>") == 5 and '<td class="l">compile ' in ranks  # a header and four ranks
    assert '<th class="l">what</th>' in text and '<td class="l">training steps that count</td>' in text
    assert "<th>lag, summed</th>" in text and html.escape(LAG_NOTE) in text
    # Tables and notes end well above the toolbar of the chart under them, never over it.
    bars = [b["modebar"] for b in boxes if b["modebar"]]
    assert bars and plots.table_boxes
    for table in plots.table_boxes:
        for bar in bars:
            assert not overlaps(table, bar), (table, bar)
            if bar[1] >= table[1]:  # a toolbar below this table
                assert bar[1] - table[3] >= 16, (table, bar)
