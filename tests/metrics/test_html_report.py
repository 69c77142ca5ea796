"""The HTML report in a real headless Chromium: it renders, its charts are drawn, the console is clean."""

from __future__ import annotations

from pathlib import Path

import pytest

from _chromium import CHROMIUM, assert_titles_clear, load, overlaps
from _timelines import ev, run_of, span
from warmstart.metrics.calculator import compute, load_runs
from warmstart.metrics.report import render_html
from warmstart.metrics.windows import TimeFilter, apply

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it)")


def _load_in_chromium(page, tmp_path):
    plots, problems, _ = load(page, tmp_path)
    return plots, problems


def _run_with_everything(run_dir: Path):
    return run_of(run_dir, [
        ev(0, "attempt_start", devices=8), *span(0, 4, "process_group_init"), *span(2, 9, "compile"),
        *span(3, 6, "sharding_plan"), ev(10, "step", step=0), ev(11, "step", step=1),
        *span(11.5, 12, "checkpoint_save"), ev(12.5, "checkpoint_committed", step=1), ev(13, "step", step=2),
        *span(13.5, 14, "eval"), ev(15, "step", step=3), ev(16, "failure", reason="NCCL <timeout> & co", category="infra"),
        ev(30, "attempt_start", attempt=1, devices=8), *span(30, 33, "checkpoint_load", attempt=1),
        ev(35, "step", attempt=1, step=2), ev(36, "step", attempt=1, step=3), ev(37, "train_end", attempt=1),
        ev(40, "attempt_end", attempt=1),
    ])


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
