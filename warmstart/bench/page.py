"""The cold-vs-warm benchmark's table and page: the figures of the three configurations side by side,
then the metrics package's report of their runs."""

from __future__ import annotations

from typing import Any

from warmstart.bench.cold_vs_warm import CONFIGS, FIGURES, ConfigResult, ratios

_TITLE = "warmstart bench cold-vs-warm"
_LABELS = {
    "time_to_start_s": "time to start (s)",
    "time_to_recover_s": "time to recover (s)",
    "compile_s": "compile (s)",
    "sharding_plan_s": "sharding plan (s)",
    "checkpoint_blocking_s": "checkpoint blocking (s)",
    "e2e_s": "end to end (s)",
    "ett_pct": "ETT %",
}
_HEADERS = ("figure", *CONFIGS, "warm / baseline")


def table_rows(results: dict[str, ConfigResult]) -> list[list[Any]]:
    """One row per figure: label, baseline, cold, warm, warm/baseline (``x`` ratio)."""
    figures = {name: res.figures() for name, res in results.items()}
    ratio = ratios(results)
    rows = []
    for key in FIGURES:
        r = ratio[key]
        rows.append([_LABELS[key], *(figures[name][key] for name in CONFIGS), "-" if r is None else f"{r:.2f}x"])
    return rows


def render_page(results: dict[str, ConfigResult]) -> str:
    """A self-contained HTML page: the figures of the three configurations side by side, then the
    metrics package's report of their runs (timelines and breakdowns)."""
    from warmstart.metrics.report_html import render_html

    return render_html(
        [results[name].result for name in CONFIGS], title=_TITLE, intro=[list(_HEADERS), *table_rows(results)]
    )
