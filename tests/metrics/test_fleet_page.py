"""``warmstart ett fleet --html``: the fleet page in a real headless Chromium (its charts drawn, the
console clean, the jobs listed by lost device-hours), and the default window length."""

from __future__ import annotations

import math

import pytest
from _chromium import CHROMIUM, assert_titles_clear, load
from _timelines import T0, ev, span
from click.testing import CliRunner

from warmstart.cli import cli
from warmstart.metrics.events import write_events
from warmstart.metrics.windows import DEFAULT_WINDOWS, default_every

# Lost device-hours: big (128 devices, 15 min compile) > flaky (16 devices, a failure) > steady > small.
BY_LOSS = ["big", "flaky", "steady", "small"]


def _write_fleet(root):
    write_events(
        root / "steady" / "events.jsonl",
        [
            ev(0, "attempt_start", job="steady", devices=64),
            ev(60, "step", job="steady", step=0),
            ev(3500, "train_end", job="steady"),
            ev(3600, "attempt_end", job="steady"),
        ],
    )
    write_events(
        root / "flaky" / "events-a0.jsonl",
        [
            ev(0, "attempt_start", job="flaky", devices=16),
            *span(0, 300, "compile", job="flaky"),
            ev(300, "step", job="flaky", step=0),
            ev(900, "checkpoint_committed", job="flaky", step=0),
            ev(1600, "step", job="flaky", step=1),
            ev(1700, "failure", job="flaky", reason="ECC", category="infra"),
        ],
    )
    write_events(
        root / "flaky" / "events-a1.jsonl",
        [
            ev(2400, "attempt_start", attempt=1, job="flaky", devices=16),
            *span(2400, 2500, "checkpoint_load", attempt=1, job="flaky"),
            ev(2600, "step", attempt=1, job="flaky", step=1),
            ev(5300, "train_end", attempt=1, job="flaky"),
            ev(5400, "attempt_end", attempt=1, job="flaky"),
        ],
    )
    write_events(
        root / "small" / "events.jsonl",
        [
            ev(1000, "attempt_start", job="small", devices=1),
            ev(1100, "step", job="small", step=0),
            ev(2000, "train_end", job="small"),
            ev(2000, "attempt_end", job="small"),
        ],
    )
    write_events(
        root / "big" / "events.jsonl",
        [
            ev(600, "attempt_start", job="big", devices=128),
            *span(600, 1500, "compile", job="big"),
            ev(1500, "step", job="big", step=0),
            ev(4100, "train_end", job="big"),
            ev(4200, "attempt_end", job="big"),
        ],
    )


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_html_leaves_the_other_outputs_unchanged(tmp_path):
    _write_fleet(tmp_path / "runs")
    page = tmp_path / "fleet.html"
    for fmt in ((), ("--json",), ("--every", "30m"), ("--json", "--every", "30m")):
        plain = _invoke("ett", "fleet", str(tmp_path / "runs"), *fmt)
        with_page = _invoke("ett", "fleet", str(tmp_path / "runs"), *fmt, "--html", str(page))
        assert plain.exit_code == with_page.exit_code == 0
        assert with_page.stdout == plain.stdout
        assert f"wrote {page}" in with_page.stderr and page.stat().st_size > 0
        assert f"({page.stat().st_size / 1e6:.1f} MB, of which " in with_page.stderr  # mostly plotly.js, said so


def test_unwritable_page_is_a_one_line_error(tmp_path):
    _write_fleet(tmp_path / "runs")
    result = _invoke("ett", "fleet", str(tmp_path / "runs"), "--html", str(tmp_path / "missing" / "fleet.html"))
    assert result.exit_code == 2  # bad input, as an unwritable server --dir
    assert result.stderr.startswith("warmstart: --html ") and len(result.stderr.splitlines()) == 1
    assert "cannot write" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it)")
@pytest.mark.parametrize("every", [None, "10m"])
def test_fleet_page_renders_windows_and_jobs_by_loss(tmp_path, every):
    _write_fleet(tmp_path / "runs")
    page = tmp_path / "fleet.html"
    result = _invoke(
        "ett", "fleet", str(tmp_path / "runs"), "--html", str(page), *(["--every", every] if every else [])
    )
    assert result.exit_code == 0, result.output
    plots, problems, boxes = load(page, tmp_path)
    assert problems == []
    for div in ("fleet-windows", "fleet-jobs"):
        assert "js-plotly-plot" in plots.div_classes[div]  # plotly.js ran on it
    assert plots.bar_traces >= 8  # window buckets and per-job loss buckets were drawn
    assert [row[1] for row in plots.tables["jobs"][1:]] == BY_LOSS  # after the header row, largest loss first
    lost = [float(row[5]) for row in plots.tables["jobs"][1:]]
    assert lost == sorted(lost, reverse=True)
    assert lost[0] == pytest.approx(1000 * 128 / 3600, abs=0.01)  # big: 900 s compile + 100 s shutdown
    windows = page.read_text()
    expected = "10 windows of 10m 00s" if every else "windows of 1m 00s"  # 5400 s: 1 min makes 91
    assert expected in windows
    assert_titles_clear(boxes, ["fleet-windows", "fleet-jobs"])


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it)")
def test_fleet_page_titles_are_clear_of_the_toolbar_when_narrow(tmp_path):
    _write_fleet(tmp_path / "runs")
    page = tmp_path / "fleet.html"
    assert _invoke("ett", "fleet", str(tmp_path / "runs"), "--html", str(page)).exit_code == 0
    _, problems, boxes = load(page, tmp_path, width=800)
    assert problems == []
    assert_titles_clear(boxes, ["fleet-windows", "fleet-jobs"])


@pytest.mark.parametrize("span_s", [5, 20, 333, 3600, 86400, 7 * 86400, 400 * 86400, 10**8])
def test_default_every_makes_20_to_100_windows(span_s):
    since = T0 + 123.4
    every = default_every(since, since + span_s)
    count = math.ceil((since + span_s) / every) - math.floor(since / every)
    fewest, most = DEFAULT_WINDOWS
    assert fewest <= count <= most + 1  # a span under 20 s is cut in 20 equal windows, lined up on the epoch


def test_default_every_is_a_round_length():
    assert default_every(T0, T0 + 86400) == 900  # a day: 15-minute windows
    assert default_every(T0, T0 + 3600, origin=T0) == 60  # an hour from --since: 60 one-minute windows
