"""The self-contained HTML page of ETT results (plotly): headline, breakdown and timeline of each run,
the windows' ETT%, the slow steps, and the fleet's page.

Drawn from the same result objects as the terminal report (``report``), with the same wording of
figures (``formatting``); nothing here computes a bucket. The page inlines plotly.js from the
installed ``plotly`` package, so it opens without any network.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from warmstart.metrics.buckets import (
    COMPILE_SWITCH,
    EFFECTIVE,
    INIT_OTHER,
    LOST,
    RECOVERY,
    SHUTDOWN,
    bucket_colour,
    bucket_label,
)
from warmstart.metrics.calculator import AttemptTimeline, RunResult, ordered_buckets
from warmstart.metrics.fleet import FleetResult
from warmstart.metrics.formatting import (
    L1_LABELS,
    LAG_NOTE,
    STRAGGLER_COLUMNS,
    SWITCH_COLUMNS,
    SWITCH_TITLE,
    ett_grade,
    ett_text,
    format_duration,
    pct_text,
    rank_rows,
    slow_summary,
    step_time,
    switch_row,
)
from warmstart.metrics.windows import FleetWindow, Window, format_time

# plotly draws its mode bar (the chart toolbar) in the top right corner of a chart, where a centred or
# long title runs under it. Every chart keeps its title in a band below the bar (_title, _TOP_MARGIN)
# and drops the buttons that do nothing on these charts (box and lasso select, autoscale).
_PLOT_CONFIG = {
    "displaylogo": False,
    "responsive": True,
    "modeBarButtonsToRemove": ["select2d", "lasso2d", "autoScale2d"],
}
_TOP_MARGIN = 66  # px above the plot area: the mode bar (about 25 px), then the title


def _title(text: str) -> dict[str, Any]:
    """A chart title sitting just above the plot area, hence below the mode bar."""
    return {"text": text, "y": 1, "yref": "paper", "yanchor": "bottom", "pad": {"b": 12}}


def _plot_div(fig, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=_PLOT_CONFIG)


# A span lane is drawn when its longest span holds at least this share of the job's time (about 3 px
# of a 1,000 px wide chart): thinner bars draw nothing but an empty lane, so they are named under the
# chart instead (hundreds of 50 ms saves over a long run are such a lane).
_MIN_LANE_SHARE = 0.003
# Markers per kind (steps, checkpoints) across the chart: denser ones merge into a band.
_MAX_MARKERS = 60
_AXIS_PX = 44  # below the plot area: the x-axis ticks and its title
_LEGEND_ROW_PX = 22


def _lanes(result: RunResult) -> tuple[list[str], dict[str, list], list[str]]:
    """The timeline's lanes (one per attempt, then one per span name, across attempts: attempts never
    overlap in time), each span lane's spans, and the span names too short to draw, with their time."""
    spans: dict[str, list] = {}
    for tl in result.timeline:
        for s in tl.spans:
            if s.name != COMPILE_SWITCH:  # a moment, drawn as a marker on its attempt's lane
                spans.setdefault(s.name, []).append(s)
    shown, hidden = {}, []
    for name in sorted(spans):
        if result.e2e_s > 0 and max(s.end - s.start for s in spans[name]) >= _MIN_LANE_SHARE * result.e2e_s:
            shown[name] = spans[name]
        else:
            total = sum(s.end - s.start for s in spans[name])
            hidden.append(f"{name} ({len(spans[name])} x, {step_time(total)} in all)")
    return [f"attempt {tl.attempt}" for tl in result.timeline] + list(shown), shown, hidden


def _timeline_figure(result: RunResult):
    import plotly.graph_objects as go

    t0 = result.start_ts
    # One bar trace per legend entry, however many bars it has: thousands of checkpoint spans stay
    # one trace (a trace per bar makes a page that takes minutes to build and seconds to draw).
    traces: dict[str, dict[str, Any]] = {}

    def bar(lane: str, start: float, end: float, name: str, colour: str, hover: str) -> None:
        if end <= start:
            return
        trace = traces.setdefault(name, {"colour": colour, "y": [], "x": [], "base": [], "text": []})
        trace["y"].append(lane)
        trace["x"].append(end - start)
        trace["base"].append(start - t0)
        trace["text"].append(hover)

    lanes, span_lanes, _ = _lanes(result)
    for tl in result.timeline:
        _phase_bars(tl, f"attempt {tl.attempt}", bar)
    for name, marks in span_lanes.items():
        for s in marks:
            bar(
                name,
                s.start,
                s.end,
                s.bucket,
                bucket_colour(s.bucket),
                f"{html.escape(s.name)} (rank {s.rank}): {s.end - s.start:.3f} s",
            )
    fig = go.Figure()
    for name, trace in traces.items():
        fig.add_trace(
            go.Bar(
                y=trace["y"],
                x=trace["x"],
                base=trace["base"],
                orientation="h",
                name=name,
                legendgroup=name,
                marker_color=trace["colour"],
                text=trace["text"],
                textposition="none",
                hovertemplate="%{text}<br>from %{base:.3f} s<extra></extra>",
            )
        )
    _markers(fig, result.timeline, t0)
    _switch_markers(fig, result, t0)
    plot_px = 30 * len(lanes) + 20
    fig.update_layout(
        title=_title(f"timeline of {html.escape(result.job)}"),
        barmode="overlay",
        template="plotly_white",
        xaxis={"title": {"text": "seconds since the first attempt_start"}, "rangemode": "tozero"},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes))},
        **_legend_below(plot_px, sum(1 for t in fig.data if t.showlegend is not False), left=200),
    )
    return fig


def _legend_below(plot_px: int, entries: int, left: int) -> dict[str, Any]:
    """Layout for a chart whose plot area is ``plot_px`` high with its legend just under the x-axis
    title, whatever the chart's height: a legend placed at a share of the plot's height runs into the
    title on a short chart and leaves a gap under a tall one. The bottom margin holds the legend's
    rows as a chart 800 px wide (the narrowest the page is read at) wraps them, so plotly never
    shrinks the plot to make room, which would move the legend."""
    bottom = _AXIS_PX + 8 + _LEGEND_ROW_PX * math.ceil(entries / 4)
    height = _TOP_MARGIN + plot_px + bottom
    return {
        "height": height,
        "legend": {
            "orientation": "h",
            "yref": "container",
            "yanchor": "top",
            "y": (bottom - _AXIS_PX) / height,
            "x": 0,
        },
        "margin": {"l": left, "r": 20, "t": _TOP_MARGIN, "b": bottom},
    }


def _phase_bars(tl: AttemptTimeline, lane: str, bar) -> None:
    if tl.recovery_before:
        bar(lane, *tl.recovery_before, RECOVERY, bucket_colour(RECOVERY), "waiting to be rescheduled")
    first = tl.first_step if tl.first_step is not None else tl.end
    bar(
        lane,
        tl.start,
        first,
        "start-up (before first step)",
        bucket_colour(INIT_OTHER),
        "start-up: before the first step",
    )
    if tl.first_step is not None and tl.loop_end is not None:
        lost_from = tl.lost_from if tl.lost_from is not None else tl.loop_end
        bar(lane, tl.first_step, lost_from, "training loop", bucket_colour(EFFECTIVE), "training loop")
        bar(lane, lost_from, tl.loop_end, LOST, bucket_colour(LOST), "steps after the last committed checkpoint")
    if tl.train_end is not None:
        bar(lane, tl.train_end, tl.end, SHUTDOWN, bucket_colour(SHUTDOWN), "shutdown")
    if tl.recovery_after:
        bar(lane, *tl.recovery_after, RECOVERY, bucket_colour(RECOVERY), "after the failure")


def _markers(fig, timeline: Sequence[AttemptTimeline], t0: float) -> None:
    """Step, checkpoint and failure markers on each attempt's lane; steps and checkpoints thinned to
    every n-th (the same n on every lane) where there are more than :data:`_MAX_MARKERS`."""
    import plotly.graph_objects as go

    kinds = [
        ("steps", lambda tl: tl.steps, "step", {"symbol": "line-ns-open", "size": 9, "color": "#1b5e20"}),
        (
            "checkpoint committed",
            lambda tl: tl.checkpoints,
            "checkpoint of step",
            {"symbol": "diamond", "size": 10, "color": "#ff7f0e", "line": {"width": 1, "color": "black"}},
        ),
    ]
    seen: set[str] = set()
    for name, points_of, what, marker in kinds:
        every = max(1, math.ceil(sum(len(points_of(tl)) for tl in timeline) / _MAX_MARKERS))
        label = name if every == 1 else f"{name} (1 in {every})"
        for tl in timeline:
            points = points_of(tl)[::every]
            if points:
                _marker_trace(
                    fig,
                    go,
                    [ts - t0 for ts, _ in points],
                    f"attempt {tl.attempt}",
                    label,
                    [f"{what} {n}" for _, n in points],
                    marker,
                    seen,
                )
    for tl in timeline:
        if tl.failure:
            _marker_trace(
                fig,
                go,
                [tl.failure["ts"] - t0],
                f"attempt {tl.attempt}",
                "failure",
                [html.escape(f"{tl.failure['category']}: {tl.failure['reason']}")],
                {"symbol": "x", "size": 14, "color": "#d62728", "line": {"width": 1, "color": "black"}},
                seen,
            )


def _switch_markers(fig, result: RunResult, t0: float) -> None:
    import plotly.graph_objects as go

    seen: set[str] = set()
    for s in result.compile_switches:
        step = "before the first step" if s.during_step is None else f"during step {s.during_step:,}"
        _marker_trace(
            fig,
            go,
            [s.ts - t0],
            f"attempt {s.attempt}",
            "switched to compiled",
            [f"rank {s.rank} switched to compiled code {step}"],
            {"symbol": "star", "size": 12, "color": "#1f77b4", "line": {"width": 1, "color": "black"}},
            seen,
        )


def _marker_trace(
    fig, go, xs: list[float], lane: str, name: str, texts: list[str], marker: dict[str, Any], seen: set[str]
) -> None:
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=[lane] * len(xs),
            mode="markers",
            name=name,
            legendgroup=name,
            showlegend=name not in seen,
            marker=marker,
            text=texts,
            hovertemplate="%{text} at %{x:.3f} s<extra></extra>",
        )
    )
    seen.add(name)


def _breakdown_figure(result: RunResult):
    import plotly.graph_objects as go

    names = [n for n, s in result.buckets.items() if s > 0]
    fig = go.Figure()
    for name in names:  # one stacked bar per attempt plus the whole job
        ys = ["job"] + [f"attempt {a.attempt}" for a in result.attempts]
        xs = [result.buckets[name]] + [a.buckets.get(name, 0.0) for a in result.attempts]
        hover = html.escape(f"{name} ({bucket_label(name)})")
        fig.add_trace(
            go.Bar(
                y=ys,
                x=xs,
                name=name,
                orientation="h",
                marker_color=bucket_colour(name),
                hovertemplate=f"{hover}: %{{x:.3f}} s<extra></extra>",
            )
        )
    fig.update_layout(
        title=_title("breakdown (seconds; the bars sum to end-to-end)"),
        barmode="stack",
        template="plotly_white",
        yaxis={"autorange": "reversed"},
        **_legend_below(40 * (len(result.attempts) + 1) + 10, len(names), left=100),
    )
    return fig


def _windows_figure(
    windows: Sequence[Window | FleetWindow],
    title: str = "ETT% per window (bars: each window's buckets, % of its counted time)",
    t0: float | None = None,
):
    """Each window as a bar of its buckets (% of its counted time) under a line of ETT% per window.

    ``t0``: the x-axis counts seconds since then (a run's page, whose timeline below does the same);
    else it shows local clock time (a fleet's page, whose jobs each start at their own time).
    """
    import datetime as dt

    import plotly.graph_objects as go

    # Bars sit at each window's middle and span its length (ms on a date axis), so a short last
    # window is drawn short; clock times are local, as in the terminal table.
    if t0 is None:
        mids: list[Any] = [dt.datetime.fromtimestamp((w.since + w.until) / 2) for w in windows]
        widths = [(w.until - w.since) * 1000 for w in windows]
        xaxis: dict[str, Any] = {"type": "date"}
    else:
        mids = [(w.since + w.until) / 2 - t0 for w in windows]
        widths = [w.until - w.since for w in windows]
        xaxis = {"title": {"text": "seconds since the first attempt_start"}, "rangemode": "tozero"}
    totals = [sum(w.buckets.values()) for w in windows]
    names = [n for n in (windows[0].buckets if windows else {}) if any(w.buckets.get(n, 0) > 0 for w in windows)]
    fig = go.Figure()
    for name in names:
        hover = html.escape(f"{name} ({bucket_label(name)})")
        fig.add_trace(
            go.Bar(
                x=mids,
                y=[100 * w.buckets.get(name, 0.0) / t if t > 0 else 0 for w, t in zip(windows, totals, strict=True)],
                width=widths,
                name=name,
                marker_color=bucket_colour(name),
                opacity=0.55,
                hovertemplate=f"{hover}: %{{y:.1f}}%<extra></extra>",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=mids,
            y=[w.ett_pct for w in windows],
            mode="lines+markers",
            name="ETT%",
            connectgaps=False,
            line={"color": "#1b5e20", "width": 3},
            marker={"size": 7},
            text=[f"{format_time(w.since)} + {format_duration(w.until - w.since)}" for w in windows],
            hovertemplate="ETT %{y:.1f}%<br>%{text}<extra></extra>",
        )
    )
    fig.update_layout(
        title=_title(title),
        barmode="stack",
        template="plotly_white",
        bargap=0,
        yaxis={"title": "% of counted time", "range": [0, 100]},
        xaxis=xaxis,
        **_legend_below(280, len(names) + 1, left=60),
    )
    return fig


def _html_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], css_class: str = "", *, text: Sequence[int] = ()
) -> str:
    """A table whose first column and the ``text`` columns are aligned left (words read from their
    start, next to what they describe), the others right (numbers)."""

    def cell(tag: str, i: int, value: Any) -> str:
        align = ' class="l"' if i in text else ""
        return f"<{tag}{align}>{html.escape(str(value))}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", i, c) for i, c in enumerate(row)) + "</tr>" for row in rows)
    attr = f' class="{css_class}"' if css_class else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _slow_steps_html(result: RunResult) -> str:
    slow = result.slow_steps
    if slow is None or slow.ideal_step_s is None or slow.slow_above_s is None:
        return ""
    steps = ""
    if slow.slowest_steps:  # none when no step was slow: the summary says so
        steps = (
            "<div>"
            + _html_table(
                ("attempt", "step", "duration", "over ideal"),
                [
                    (s.attempt, f"{s.step:,}", step_time(s.duration_s), step_time(s.excess_s))
                    for s in slow.slowest_steps
                ],
            )
            + "</div>"
        )
    ranks = ""
    if slow.slowest_ranks:
        ranks = (
            "<div><h3>Stragglers</h3>"
            + _html_table(
                STRAGGLER_COLUMNS,
                [
                    (
                        r.rank,
                        f"{r.lagged_steps:,}",
                        format_duration(r.lag_s),
                        ", ".join(f"{lag.attempt}/{lag.step}: {step_time(lag.lag_s)}" for lag in r.worst[:5]),
                    )
                    for r in slow.slowest_ranks
                ],
                text=(3,),
            )
            + f'<p class="note">{html.escape(LAG_NOTE)}.</p></div>'
        )
    summary = slow_summary(slow, slow.ideal_step_s, slow.slow_above_s, result.e2e_s)
    tables = f'<div class="tables">{steps}{ranks}</div>' if steps or ranks else ""
    return f'<div class="slow"><h3>Slow steps</h3><p>{html.escape(summary)}</p>{tables}</div>'


def _ranks_html(result: RunResult) -> str:
    if len(result.ranks) < 2:
        return ""
    rows = rank_rows(result.ranks, EFFECTIVE)
    return f"<div><h3>Ranks</h3>{_html_table(('rank', 'ETT%', 'largest other bucket'), rows, text=(2,))}</div>"


def _switches_html(result: RunResult) -> str:
    if not result.compile_switches:
        return ""
    rows = [switch_row(s) for s in result.compile_switches]
    title = html.escape(SWITCH_TITLE.capitalize())
    return f'<div class="switches"><h3>{title}</h3>{_html_table(SWITCH_COLUMNS, rows)}</div>'


def _run_section(result: RunResult, index: int) -> str:
    e2e = result.e2e_s
    l1_rows = [(label, format_duration(result.l1[key]), pct_text(result.l1[key], e2e)) for key, label in L1_LABELS]
    l1_rows.append(
        ("failures", result.l1["failures"], ", ".join(f"{k} {v}" for k, v in result.l1["failures_by_category"].items()))
    )
    l2_rows = [(name, f"{s:,.3f}", pct_text(s, e2e), bucket_label(name)) for name, s in result.buckets.items() if s > 0]
    timeline = _plot_div(_timeline_figure(result), f"timeline-{index}")
    breakdown = _plot_div(_breakdown_figure(result), f"breakdown-{index}")
    windows = (
        _plot_div(_windows_figure(result.windows, t0=result.start_ts), f"windows-{index}") if result.windows else ""
    )
    hidden = _lanes(result)[2]
    hidden_html = (
        f'<p class="note">Spans too short to draw in the timeline: {html.escape(", ".join(hidden))}.</p>'
        if hidden
        else ""
    )
    warnings_html = "".join(f"<li>{html.escape(w)}</li>" for w in result.warnings)
    return f"""
<section class="run">
  <h2>{html.escape(result.job)} <small>{html.escape(result.run_dir)}</small></h2>
  <div class="headline"><span class="ett {ett_grade(result.ett_pct)}">{ett_text(result.ett_pct)}</span> ETT
    <span class="facts">end-to-end {format_duration(e2e)} · {result.devices} device(s) ·
    {len(result.attempts)} attempt(s) · {result.l1["failures"]} failure(s)</span></div>
  <div class="tables"><div><h3>L1</h3>{_html_table(("figure", "time", "% of e2e"), l1_rows)}</div>
  <div><h3>L2 buckets</h3>{_html_table(("bucket", "seconds", "% of e2e", "what"), l2_rows, text=(3,))}</div>
  {_ranks_html(result)}</div>
  {_slow_steps_html(result)}
  {_switches_html(result)}
  {breakdown}
  {windows}
  {timeline}
  {hidden_html}
  {f'<ul class="warnings">{warnings_html}</ul>' if warnings_html else ""}
</section>"""


def render_html(
    results: Sequence[RunResult], title: str = "warmstart ETT report", *, intro: Sequence[Sequence[Any]] | None = None
) -> str:
    """One self-contained page (plotly.js inlined, no network) with a section per run.

    ``intro``: a table shown above the runs, as rows whose first row is the header (e.g. the
    figures of a benchmark comparing them); cells are escaped.
    """
    sections = (_intro_table(intro) if intro else "") + "".join(_run_section(r, i) for i, r in enumerate(results))
    return _page(title, sections)


def render_fleet_html(
    fleet: FleetResult,
    title: str = "warmstart fleet ETT report",
    *,
    windows: Sequence[FleetWindow] | None = None,
    top: int = 30,
    rows: int = 200,
) -> str:
    """One self-contained page for a fleet: fleet ETT% and its buckets, fleet ETT% per time window, and
    the jobs that lost the most device-hours, first (a chart of the ``top`` largest, a table of ``rows``).

    ``windows``: the series to chart (default ``fleet.windows``; none: no chart).
    """
    windows = fleet.windows if windows is None else windows
    total = fleet.device_seconds
    facts = (
        f"{fleet.jobs:,} job(s) · {total / 3600:,.1f} device-hours · {fleet.failures:,} failure(s) · "
        f"weighted by device-seconds"
    )
    bucket_rows = [
        (name, f"{s / 3600:,.2f}", pct_text(s, total), bucket_label(name))
        for name, s in fleet.to_dict()["buckets"].items()
        if s > 0
    ]
    parts = [
        f'<div class="headline"><span class="ett {ett_grade(fleet.ett_pct)}">{ett_text(fleet.ett_pct)}</span>'
        " fleet ETT "
        f'<span class="facts">{html.escape(facts)}</span></div>',
        f'<div class="tables"><div><h3>Buckets</h3>'
        f"{_html_table(('bucket', 'device-hours', '% of total', 'what'), bucket_rows, text=(3,))}</div></div>",
    ]
    if windows:
        every = windows[0].until - windows[0].since
        parts.append(
            f"<h2>Over time</h2><p>{len(windows):,} windows of {html.escape(format_duration(every))} (local time)</p>"
        )
        parts.append(
            _plot_div(
                _windows_figure(windows, "fleet ETT% per window (bars: each window's buckets, % of its device-time)"),
                "fleet-windows",
            )
        )
    ranked = _jobs_by_loss(fleet)
    if ranked:
        shown = min(rows, len(ranked))
        parts.append(
            f"<h2>Jobs by lost device-hours</h2><p>{shown:,} of {len(ranked):,} job(s), the largest "
            f"loss first; lost = every bucket but {EFFECTIVE}.</p>"
        )
        parts.append(_plot_div(_job_losses_figure(ranked[:top]), "fleet-jobs"))
        parts.append(
            _html_table(
                ("#", "job", "devices", "wall", "ETT%", "lost device-hours", "largest loss", "failures", "run dir"),
                [
                    (
                        n,
                        run["job"],
                        run["devices"],
                        format_duration(run["e2e_s"]),
                        f"{run['ett_pct']:.1f}",
                        f"{lost / 3600:,.2f}",
                        _largest_loss(buckets),
                        run["failures"],
                        run["run_dir"],
                    )
                    for n, (run, buckets, lost) in enumerate(ranked[:rows], 1)
                ],
                css_class="jobs",
            )
        )
    return _page(title, f'<section class="fleet">{"".join(parts)}</section>')


def _jobs_by_loss(fleet: FleetResult) -> list[tuple[dict[str, Any], dict[str, float], float]]:
    """(run row, its buckets in device-seconds, lost device-seconds) per job, the largest loss first."""
    ranked = [
        (run, buckets, sum(s for name, s in buckets.items() if name != EFFECTIVE))
        for run, buckets in zip(fleet.runs, fleet.run_buckets, strict=True)
    ]
    return sorted(ranked, key=lambda item: -item[2])


def _largest_loss(buckets: dict[str, float]) -> str:
    others = {name: s for name, s in buckets.items() if name != EFFECTIVE and s > 0}
    if not others:
        return "-"
    worst = max(others, key=others.__getitem__)
    return f"{worst} {others[worst] / 3600:,.2f}"


def _job_losses_figure(ranked: Sequence[tuple[dict[str, Any], dict[str, float], float]]):
    """One stacked bar per job: its lost device-hours by bucket, the largest loss on top."""
    import plotly.graph_objects as go

    # Numbered labels: two run directories may hold jobs of the same name.
    labels = [f"{n}. {run['job']}" for n, (run, _, _) in enumerate(ranked, 1)]
    names = _held_buckets([buckets for _, buckets, _ in ranked])
    fig = go.Figure()
    for name in names:
        if name == EFFECTIVE:
            continue
        hover = html.escape(f"{name} ({bucket_label(name)})")
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[buckets.get(name, 0.0) / 3600 for _, buckets, _ in ranked],
                name=name,
                orientation="h",
                marker_color=bucket_colour(name),
                text=[html.escape(run["run_dir"]) for run, _, _ in ranked],
                textposition="none",
                hovertemplate=f"{hover}: %{{x:,.2f}} device-hours<br>%{{text}}<extra></extra>",
            )
        )
    fig.update_layout(
        title=_title("lost device-hours per job, by bucket"),
        barmode="stack",
        template="plotly_white",
        height=_TOP_MARGIN + 120 + 26 * len(ranked),
        xaxis_title="device-hours",
        yaxis={"autorange": "reversed", "type": "category"},
        legend={"traceorder": "normal"},
        margin={"l": 200, "r": 20, "t": _TOP_MARGIN, "b": 40},
    )
    return fig


def _held_buckets(many: Sequence[dict[str, float]]) -> list[str]:
    """The buckets holding time in any of ``many``, in report order."""
    held = {name for buckets in many for name, s in buckets.items() if s > 0}
    return [name for name in ordered_buckets(dict.fromkeys(held, 0.0)) if name in held]


def _page(title: str, body: str) -> str:
    """The self-contained page around ``body``: styles and plotly.js inlined, no network."""
    from plotly.offline import get_plotlyjs

    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
h2 small {{ color: #888; font-weight: normal; font-size: 0.6em; }}
.headline {{ margin: 0.5em 0 1em; }} .ett {{ font-size: 3em; font-weight: bold; }}
.ett.good {{ color: #2ca02c; }} .ett.fair {{ color: #b8860b; }} .ett.poor {{ color: #d62728; }}
.note {{ color: #666; font-size: 0.9em; }}
.facts {{ color: #666; margin-left: 1em; }}
.tables {{ display: flex; gap: 3em; flex-wrap: wrap; }}
table {{ border-collapse: collapse; }} th, td {{ padding: 2px 10px; text-align: right; }}
th:first-child, td:first-child, th.l, td.l {{ text-align: left; }} thead {{ border-bottom: 1px solid #aaa; }}
.tables, .slow, .switches {{ margin-bottom: 2em; }}
table.intro {{ margin-bottom: 1.5em; }} table.jobs td {{ white-space: nowrap; }}
.warnings {{ color: #a60; }} section.run {{ border-top: 2px solid #eee; padding-top: 1em; }}
</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body><h1>{html.escape(title)}</h1>{body}
</body></html>
"""


def _intro_table(rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in row) + "</tr>" for row in rows[1:])
    return f'<table class="intro"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _cell(value: Any) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else str(value)
