"""Load a page in headless Chromium for the HTML tests: the DOM after plotly ran, console problems, and
the on-screen boxes of each chart's title, mode bar (toolbar) and plot area."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

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

# Put after the page under test: once plotly has drawn, write each chart's boxes (viewport px, as
# [left, top, right, bottom]) into a <pre id="chart-boxes"> that --dump-dom then returns.
_BOXES = """<script>
window.addEventListener("load", function () {
  setTimeout(function () {
    function box(el) {
      if (!el) { return null; }
      var r = el.getBoundingClientRect();
      return [r.left, r.top, r.right, r.bottom];
    }
    var out = [];
    document.querySelectorAll(".js-plotly-plot").forEach(function (plot) {
      out.push({id: plot.id, title: box(plot.querySelector(".gtitle")), modebar: box(plot.querySelector(".modebar")),
                plot: box(plot.querySelector(".nsewdrag")), legend: box(plot.querySelector(".legend")),
                xtitle: box(plot.querySelector(".xtitle"))});
    });
    var pre = document.createElement("pre");
    pre.id = "chart-boxes";
    pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
    var tables = document.createElement("pre");
    tables.id = "table-boxes";
    tables.textContent = JSON.stringify(Array.from(document.querySelectorAll("table, p.note")).map(box));
    document.body.appendChild(tables);
  }, 1000);
});
</script>"""


class Plots(HTMLParser):
    """Collects the class of each plot div, counts the SVGs plotly draws, and keeps the table rows."""

    def __init__(self) -> None:
        super().__init__()
        self.div_classes: dict[str, str] = {}
        self.main_svgs = 0
        self.bar_traces = 0
        self.points = 0
        self.tables: dict[str, list[list[str]]] = {}  # class -> rows of cell text
        self.table_boxes: list[list[float]] = []  # each table's and note's box, set by load()
        self._table: str | None = None
        self._cell: list[str] | None = None

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
        if tag == "table":
            self._table = attrs.get("class") or ""
            self.tables.setdefault(self._table, [])
        if tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        if tag == "td" and self._table is not None:
            self._cell = []

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        if tag == "table":
            self._table = None


def load(page: Path, tmp_path: Path, width: int = 1400) -> tuple[Plots, list[str], list[dict]]:
    """Load ``page`` in Chromium ``width`` px wide: the DOM as :class:`Plots`, the console problems, and
    one ``{"id", "title", "modebar", "plot", "legend", "xtitle"}`` dict of boxes per chart (``None``
    for a part the chart lacks)."""
    instrumented = tmp_path / f"instrumented-{width}-{page.name}"
    text = page.read_text().replace("<head>", "<head>" + _HOOK, 1)
    instrumented.write_text(text.replace("</body>", _BOXES + "</body>", 1) if "</body>" in text else text + _BOXES)
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=10000",
            f"--window-size={width},2000",
            "--dump-dom",
            instrumented.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    problems = [line for line in console if "PAGE-CONSOLE-" in line or "Uncaught" in line]
    plots = Plots()
    plots.feed(proc.stdout)
    found = re.search(r'<pre id="chart-boxes">(.*?)</pre>', proc.stdout, re.S)
    boxes = json.loads(html.unescape(found.group(1))) if found else []
    tables = re.search(r'<pre id="table-boxes">(.*?)</pre>', proc.stdout, re.S)
    plots.table_boxes = json.loads(html.unescape(tables.group(1))) if tables else []
    return plots, problems, boxes


def overlaps(a: list[float], b: list[float]) -> bool:
    """Whether two [left, top, right, bottom] boxes share any area."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def assert_titles_clear(boxes, charts):
    """Each chart's title lies clear of its mode bar and above its plot area."""
    assert sorted(b["id"] for b in boxes) == sorted(charts)
    for b in boxes:
        assert b["title"] and b["modebar"] and b["plot"], b
        assert not overlaps(b["title"], b["modebar"]), b
        assert b["title"][3] <= b["plot"][1], b  # the title ends above the plot area
