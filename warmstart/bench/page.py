"""The cold-vs-warm benchmark's table and page: the figures of the three configurations side by side,
then the metrics package's report of their runs."""

from __future__ import annotations

from typing import Any

from warmstart.bench.cold_vs_warm import CONFIGS, FIGURES, ConfigResult, loss_differences, ratios

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
        rows.append([_LABELS[key], *(figures[name][key] for name in CONFIGS), ratio_cell(r)])
    differences = loss_differences(results)
    rows.append(
        ["loss, largest difference from baseline", "-", *(_loss_cell(differences[n]) for n in CONFIGS[1:]), "-"]
    )
    return rows


def ratio_cell(ratio: float | None) -> str:
    """``0.60x``; a ratio under 0.1 with three decimals (``0.046x``, not ``0.05x``)."""
    if ratio is None:
        return "-"
    return f"{ratio:.3f}x" if abs(ratio) < 0.1 else f"{ratio:.2f}x"


def _loss_cell(difference: dict[str, Any]) -> str:
    """``0``, or the difference as ``1.2e-07``; the steps compared when not all of the baseline's were."""
    if difference["max_abs_diff"] is None:
        return "no step compared"
    cell = "0" if difference["max_abs_diff"] == 0 else f"{difference['max_abs_diff']:.1e}"
    if difference["compared"] < difference["baseline"]:
        cell += f" ({difference['compared']} of {difference['baseline']} steps)"
    return cell


def render_page(results: dict[str, ConfigResult]) -> str:
    """A self-contained HTML page: the figures of the three configurations side by side, then the
    metrics package's report of their runs (timelines and breakdowns)."""
    from warmstart.metrics.report_html import render_html

    return render_html(
        [results[name].result for name in CONFIGS], title=_TITLE, intro=[list(_HEADERS), *table_rows(results)]
    )
