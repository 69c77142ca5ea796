"""The HTML report in a real headless Chromium: it renders, its charts are drawn, the console is clean."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from _timelines import ev, run_of, span
from warmstart.metrics.report import render_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it)")

# Instrumentation put in front of the page under test: console.error/warn and uncaught errors become
# console lines with a marker, since Chromium logs every console level alike.
_HOOK = """<script>
(function () {
  var log = console.log.bind(console);
  ["error", "warn"].forEach(function (level) {
    console[level] = function () { log("PAGE-CONSOLE-" + level + ": " + Array.from(arguments).join(" ")); };
  });
  window.addEventListener("error", function (e) { log("PAGE-CONSOLE-error: " + e.message); });
})();
</script>"""


class _Plots(HTMLParser):
    """Collects the class of each plot div and counts the SVGs plotly draws."""

    def __init__(self) -> None:
        super().__init__()
        self.div_classes: dict[str, str] = {}
        self.main_svgs = 0
        self.bar_traces = 0
        self.points = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "div" and attrs.get("id"):
            self.div_classes[attrs["id"]] = " ".join(classes)
        if "main-svg" in classes:
            self.main_svgs += 1
        if "trace" in classes and "bars" in classes:
            self.bar_traces += 1
        if "point" in classes:
            self.points += 1


def _load_in_chromium(page: Path, tmp_path: Path) -> tuple[_Plots, list[str]]:
    instrumented = tmp_path / f"instrumented-{page.name}"
    instrumented.write_text(page.read_text().replace("<head>", "<head>" + _HOOK, 1))
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", "--window-size=1400,2000",
         "--dump-dom", instrumented.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    problems = [line for line in console if "PAGE-CONSOLE-" in line or "Uncaught" in line]
    plots = _Plots()
    plots.feed(proc.stdout)
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
    assert any(re.search(r"missingFn", line) for line in problems)
