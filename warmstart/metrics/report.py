"""Reports of ETT results: terminal tables (rich), JSON and a self-contained HTML page (plotly).

Every format is drawn from the same result objects (:class:`~warmstart.metrics.calculator.RunResult`,
:class:`~warmstart.metrics.fleet.FleetResult`, :class:`~warmstart.metrics.advisor.IntervalAdvice`);
nothing here computes a bucket. The HTML page inlines plotly.js from the installed ``plotly`` package,
so it opens without any network.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from warmstart.metrics.advisor import IntervalAdvice
from warmstart.metrics.buckets import EFFECTIVE, INIT_OTHER, LOST, RECOVERY, SHUTDOWN, bucket_colour, bucket_label
from warmstart.metrics.calculator import AttemptTimeline, RunResult, ordered_buckets
from warmstart.metrics.fleet import FleetResult
from warmstart.metrics.projection import Projection
from warmstart.metrics.windows import FleetWindow, Window, format_time

_L1_LABELS = (("time_to_start_s", "time to start"), ("time_to_recover_s", "time to recover"),
              ("lost_progress_s", "lost progress"), ("checkpoint_blocking_s", "checkpoint blocking"),
              ("shutdown_s", "shutdown"))


def format_duration(seconds: float) -> str:
    """``3725.4`` -> ``1h 02m 05s``; under a minute, seconds with two decimals."""
    if seconds < 60:
        return f"{seconds:.2f} s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def _bar(fraction: float, width: int = 20) -> str:
    filled = max(0, min(width, int(round(fraction * width))))
    return "█" * filled + "·" * (width - filled)


def _console(console: Console | None) -> Console:
    if console is not None:
        return console
    probe = Console()
    return Console(soft_wrap=False, width=max(100, probe.width))


# -- terminal ------------------------------------------------------------------------------------------

def print_run(result: RunResult, console: Console | None = None) -> None:
    """Print one run: ETT% large, the L1 figures, the L2 buckets, the attempts, the ranks."""
    out = _console(console)
    e2e = result.e2e_s
    colour = "green" if result.ett_pct >= 80 else "yellow" if result.ett_pct >= 50 else "red"
    headline = Text.assemble(("ETT ", "bold"), (f"{result.ett_pct:5.1f}%", f"bold {colour}"), "  ",
                             (_bar(result.ett_pct / 100, 30), colour))
    facts = Text(f"end-to-end {format_duration(e2e)} · {result.devices} device(s) · "
                 f"{len(result.attempts)} attempt(s) · {result.l1['failures']} failure(s)", style="dim")
    out.print(Panel(Group(headline, facts), title=f"[bold]{result.job}[/]", subtitle=result.run_dir,
                    expand=False))

    l1 = Table(title="L1: where the time went", title_justify="left", show_edge=False, header_style="bold")
    for col, justify in (("figure", "left"), ("time", "right"), ("% of e2e", "right")):
        l1.add_column(col, justify=justify)  # type: ignore[arg-type]
    for key, label in _L1_LABELS:
        l1.add_row(label, format_duration(result.l1[key]), _pct(result.l1[key], e2e))
    by_cat = ", ".join(f"{k} {v}" for k, v in result.l1["failures_by_category"].items())
    l1.add_row("failures", str(result.l1["failures"]), by_cat or "")
    out.print(l1)

    l2 = Table(title="L2: buckets (they sum to end-to-end)", title_justify="left", show_edge=False,
               header_style="bold")
    for col, justify in (("bucket", "left"), ("seconds", "right"), ("%", "right"), ("", "left")):
        l2.add_column(col, justify=justify)  # type: ignore[arg-type]
    hidden = 0
    for name, seconds in result.buckets.items():
        if seconds <= 0:
            hidden += 1
            continue
        style = "green" if name == EFFECTIVE else "red" if name in (LOST, RECOVERY) else ""
        l2.add_row(Text(name, style=style), f"{seconds:,.2f}", _pct(seconds, e2e),
                   _bar(seconds / e2e if e2e else 0))
    l2.add_row(Text("end-to-end", style="bold"), f"{e2e:,.2f}", "100.0%", "")
    out.print(l2)
    if hidden:
        out.print(f"[dim]{hidden} empty bucket(s) hidden; --json lists all[/]")

    if len(result.attempts) > 1 or any(a.failed for a in result.attempts):
        at = Table(title="attempts", title_justify="left", show_edge=False, header_style="bold")
        for col in ("#", "wall", "to first step", "recovery wait", "steps", "lost", "ETT%", "ended by"):
            at.add_column(col, justify="left" if col in ("#", "ended by") else "right")
        for a in result.attempts:
            ended = "train_end" if not a.failed else f"{a.failure['category']}: {a.failure['reason']}"[:60]
            at.add_row(str(a.attempt), format_duration(a.e2e_s), format_duration(a.pre_first_step_s),
                       format_duration(a.recovery_wait_s), f"{a.steps:,}", format_duration(a.buckets[LOST]),
                       f"{a.ett_pct:.1f}", ended)
        out.print(at)
    if len(result.ranks) > 1:
        rt = Table(title="ranks", title_justify="left", show_edge=False, header_style="bold")
        for col in ("rank", "ETT%", "largest other bucket"):
            rt.add_column(col, justify="right" if col == "ETT%" else "left")
        for rank, data in sorted(result.ranks.items()):
            others = {k: v for k, v in data["buckets"].items() if k != EFFECTIVE and v > 0}
            worst = max(others, key=others.__getitem__) if others else "-"
            worst_txt = f"{worst} {_pct(others[worst], data['e2e_s'])}" if others else "-"
            rt.add_row(str(rank), f"{data['ett_pct']:.1f}", worst_txt)
        out.print(rt)
    if result.slow_steps is not None and result.slow_steps.measured_steps:
        print_slow_steps(result, out)
    if result.windows is not None:
        print_windows(result.windows, out)


def print_windows(windows: Sequence[Window | FleetWindow], console: Console | None = None) -> None:
    """Print a series of time windows: start (local time), length, counted time, ETT% with a bar, the
    largest other bucket and the failures. Fleet windows count device-hours and add the number of jobs."""
    import datetime as dt

    out = _console(console)
    fleet = any(isinstance(w, FleetWindow) for w in windows)
    offset = dt.datetime.now().astimezone().strftime("%z")
    table = Table(title=f"windows (local time, UTC{offset}; excluded time not counted)", title_justify="left",
                  show_edge=False, header_style="bold")
    # The fleet's extra column costs the bar: the table must fit 100 columns.
    columns = ["since", "length", *(["device-hours", "jobs", "ETT%"] if fleet else ["counted", "ETT%", ""]),
               "largest other bucket", "failures"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("since", "", "largest other bucket") else "right",
                         no_wrap=True)
    for w in windows:
        counted = sum(w.buckets.values())
        others = {k: v for k, v in w.buckets.items() if k != EFFECTIVE and v > 0}
        worst = max(others, key=others.__getitem__) if others else None
        ett = "-" if w.ett_pct is None else f"{w.ett_pct:.1f}"
        row = [dt.datetime.fromtimestamp(w.since).strftime("%Y-%m-%d %H:%M:%S"), format_duration(w.until - w.since)]
        if isinstance(w, FleetWindow):
            row += [f"{counted / 3600:,.2f}", f"{w.jobs:,}", ett]
        else:
            row += [format_duration(counted), ett, _bar((w.ett_pct or 0.0) / 100, 10)]
        row += [f"{worst} {_pct(others[worst], counted)}" if worst else "-", str(w.failures)]
        table.add_row(*row)
    out.print(table)


def print_slow_steps(result: RunResult, console: Console | None = None, top: int = 5) -> None:
    """Print the slow-steps diagnostic: ideal step time, time lost to slow steps, the slowest steps and
    the ranks the others waited for."""
    out = _console(console)
    slow = result.slow_steps
    if slow is None or slow.ideal_step_s is None:
        return
    out.print(Text(_slow_summary(result), style="bold"))
    if slow.slowest_steps:
        table = Table(title="slowest steps", title_justify="left", show_edge=False, header_style="bold")
        for col in ("attempt", "step", "duration", "over ideal"):
            table.add_column(col, justify="right")
        for s in slow.slowest_steps[:top]:
            table.add_row(str(s.attempt), f"{s.step:,}", _step_time(s.duration_s), _step_time(s.excess_s))
        out.print(table)
    for s in slow.interrupted:
        out.print(f"[dim]step {s.step:,} of attempt {s.attempt} was running when the attempt failed, "
                  f"{_step_time(s.running_s)} in (not timed)[/]")
    if len(result.ranks) < 2:
        return
    if not slow.slowest_ranks:
        out.print(f"[dim]stragglers: none (no rank's step ended after all the others' by more than "
                  f"{_step_time(slow.slow_above_s - slow.ideal_step_s)})[/]")
        return
    ranks = Table(title="stragglers: ranks whose step ended after every other rank's", title_justify="left",
                  show_edge=False, header_style="bold")
    for col in ("rank", "lagged steps", "total lag", "worst (attempt/step: lag)"):
        ranks.add_column(col, justify="left" if col.startswith("worst") else "right")
    for r in slow.slowest_ranks[:top]:
        worst = ", ".join(f"{lag.attempt}/{lag.step}: {_step_time(lag.lag_s)}" for lag in r.worst[:3])
        ranks.add_row(str(r.rank), f"{r.lagged_steps:,}", format_duration(r.lag_s), worst)
    out.print(ranks)


def _step_time(seconds: float) -> str:
    """Step-sized durations: milliseconds under a second."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else format_duration(seconds)


def _slow_summary(result: RunResult) -> str:
    slow = result.slow_steps
    return (f"slow steps: ideal step {_step_time(slow.ideal_step_s)} (trimmed median of {slow.measured_steps:,} "
            f"steps of rank {slow.rank}); {slow.slow_count:,} slower than {_step_time(slow.slow_above_s)} "
            f"lost {format_duration(slow.lost_s)} ({_pct(slow.lost_s, result.e2e_s)} of end-to-end)")


def print_fleet(fleet: FleetResult, console: Console | None = None, top: int = 20) -> None:
    """Print fleet ETT%, the device-second weighted buckets and the jobs with the lowest ETT%."""
    out = _console(console)
    total = fleet.device_seconds
    colour = "green" if fleet.ett_pct >= 80 else "yellow" if fleet.ett_pct >= 50 else "red"
    out.print(Panel(Group(
        Text.assemble(("fleet ETT ", "bold"), (f"{fleet.ett_pct:5.1f}%", f"bold {colour}"), "  ",
                      (_bar(fleet.ett_pct / 100, 30), colour)),
        Text(f"{fleet.jobs:,} job(s) · {total / 3600:,.1f} device-hours · {fleet.failures:,} failure(s)",
             style="dim")), title="[bold]fleet[/] (weighted by device-seconds)", expand=False))
    table = Table(title="buckets (device-hours)", title_justify="left", show_edge=False, header_style="bold")
    for col, justify in (("bucket", "left"), ("device-hours", "right"), ("%", "right"), ("", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, seconds in fleet.to_dict()["buckets"].items():
        if seconds > 0:
            table.add_row(name, f"{seconds / 3600:,.2f}", _pct(seconds, total), _bar(seconds / total if total else 0))
    out.print(table)
    worst = sorted(fleet.runs, key=lambda r: r["ett_pct"])[:top]
    jobs = Table(title=f"lowest ETT% ({len(worst)} of {fleet.jobs:,})", title_justify="left", show_edge=False,
                 header_style="bold")
    for col in ("job", "devices", "wall", "ETT%", "failures", "run dir"):
        jobs.add_column(col, justify="left" if col in ("job", "run dir") else "right")
    for r in worst:
        jobs.add_row(r["job"], str(r["devices"]), format_duration(r["e2e_s"]), f"{r['ett_pct']:.1f}",
                     str(r["failures"]), r["run_dir"])
    out.print(jobs)
    if fleet.windows is not None:
        print_windows(fleet.windows, out)


def print_interval(advice: IntervalAdvice, console: Console | None = None) -> None:
    """Print the advised checkpoint interval and the waste at it."""
    out = _console(console)
    table = Table(title="checkpoint interval (first-order optimum sqrt(2·MTBF·blocking))", title_justify="left",
                  show_edge=False, header_style="bold")
    table.add_column("", justify="left")
    table.add_column("value", justify="right")
    rows = [("blocking per checkpoint", format_duration(advice.blocking_s)),
            ("failures per day", f"{advice.failures_per_day:g}"),
            ("mean time between failures", format_duration(advice.mtbf_s)),
            ("advised interval", format_duration(advice.interval_s)),
            ("waste at it", f"{advice.waste_pct:.2f}% ({advice.blocked_pct:.2f}% blocked + "
                            f"{advice.lost_pct:.2f}% lost)")]
    if advice.current_interval_s is not None:
        rows.append((f"waste at current {format_duration(advice.current_interval_s)}",
                     f"{advice.current_waste_pct:.2f}%"))
    for row in rows:
        table.add_row(*row)
    out.print(table)
    if not advice.first_order_valid:
        out.print("[yellow]warning:[/] the interval is not small against the time between failures; the "
                  "first-order model is rough here")


def print_projections(projections: Sequence[Projection], console: Console | None = None) -> None:
    """Print projections side by side: one column per run, the projected figures, then the inputs."""
    out = _console(console)
    if not projections:
        return
    scales = {(p.devices, round(p.days, 6)) for p in projections}
    title = "ETT% projected"
    if len(scales) == 1 and not any(p.failures_from == "run" for p in projections):
        title += f" to {projections[0].devices:,} devices x {projections[0].days:g} days"
    table = Table(title=title, title_justify="left", show_edge=False, header_style="bold")
    table.add_column("", justify="left")
    for p in projections:
        table.add_column(p.costs.job, justify="right")

    def row(label: str, cells: Sequence[str], style: str = "") -> None:
        table.add_row(Text(label, style=style), *[Text(c, style=style) for c in cells])

    row("projected ETT%", [f"{p.projected_ett_pct:.2f}" for p in projections], "bold")
    row("measured ETT% (the run)", [f"{p.costs.ett_pct:.2f}" for p in projections])
    row("devices", [f"{p.devices:,}" for p in projections])
    row("end-to-end", [format_duration(p.e2e_s) for p in projections])
    row("failures", [f"{p.failures:,.1f} ({p.failures_from})" for p in projections])
    row("mean time between failures", ["-" if p.mtbf_h is None else format_duration(p.mtbf_h * 3600)
                                       for p in projections])
    row("checkpoint interval", ["-" if p.checkpoint_interval_s is None else
                                f"{format_duration(p.checkpoint_interval_s)} ({p.interval_from})" for p in projections])
    for key, label in _L1_LABELS:
        row(label, [f"{format_duration(p.l1[key])} ({_pct(p.l1[key], p.e2e_s)})" for p in projections])
    row("per start (measured)", [format_duration(p.costs.start_s) for p in projections], "dim")
    row("per recovery", [format_duration(p.recovery_s) for p in projections], "dim")
    row("lost per failure", [format_duration(p.lost_per_failure_s) for p in projections], "dim")
    row("blocking per checkpoint", [_step_time(p.costs.blocking_s) for p in projections], "dim")
    out.print(table)
    for p in projections:
        if not p.first_order_valid:
            out.print(f"[yellow]warning:[/] {p.costs.job}: the checkpoint interval is not small against the time "
                      f"between failures; the first-order model is rough here")


# -- HTML ----------------------------------------------------------------------------------------------

# plotly draws its mode bar (the chart toolbar) in the top right corner of a chart, where a centred or
# long title runs under it. Every chart keeps its title in a band below the bar (_title, _TOP_MARGIN)
# and drops the buttons that do nothing on these charts (box and lasso select, autoscale).
_PLOT_CONFIG = {"displaylogo": False, "responsive": True,
                "modeBarButtonsToRemove": ["select2d", "lasso2d", "autoScale2d"]}
_TOP_MARGIN = 66  # px above the plot area: the mode bar (about 25 px), then the title


def _title(text: str) -> dict[str, Any]:
    """A chart title sitting just above the plot area, hence below the mode bar."""
    return {"text": text, "y": 1, "yref": "paper", "yanchor": "bottom", "pad": {"b": 12}}


def _plot_div(fig, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=_PLOT_CONFIG)


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

    lanes: list[str] = []
    for tl in result.timeline:
        lane = f"attempt {tl.attempt}"
        lanes.append(lane)
        _phase_bars(tl, lane, bar)
        for span_name in sorted({s.name for s in tl.spans}):
            span_lane = f"attempt {tl.attempt} · {span_name}"
            lanes.append(span_lane)
            for s in tl.spans:
                if s.name == span_name:
                    bar(span_lane, s.start, s.end, s.bucket, bucket_colour(s.bucket),
                        f"{html.escape(s.name)} (rank {s.rank}): {s.end - s.start:.3f} s")
    fig = go.Figure()
    for name, trace in traces.items():
        fig.add_trace(go.Bar(
            y=trace["y"], x=trace["x"], base=trace["base"], orientation="h", name=name, legendgroup=name,
            marker_color=trace["colour"], text=trace["text"], textposition="none",
            hovertemplate="%{text}<br>from %{base:.3f} s<extra></extra>"))
    legend_seen: set[str] = set()
    for tl in result.timeline:
        _markers(fig, tl, f"attempt {tl.attempt}", t0, legend_seen)
    fig.update_layout(
        title=_title(f"timeline of {html.escape(result.job)}"), barmode="overlay",
        height=176 + 34 * len(lanes),
        xaxis_title="seconds since the first attempt_start", template="plotly_white",
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes))},
        legend={"orientation": "h", "y": -0.25}, margin={"l": 200, "r": 20, "t": _TOP_MARGIN, "b": 40})
    return fig


def _phase_bars(tl: AttemptTimeline, lane: str, bar) -> None:
    if tl.recovery_before:
        bar(lane, *tl.recovery_before, RECOVERY, bucket_colour(RECOVERY), "waiting to be rescheduled")
    first = tl.first_step if tl.first_step is not None else tl.end
    bar(lane, tl.start, first, "start-up (before first step)", bucket_colour(INIT_OTHER),
        "start-up: before the first step")
    if tl.first_step is not None and tl.loop_end is not None:
        lost_from = tl.lost_from if tl.lost_from is not None else tl.loop_end
        bar(lane, tl.first_step, lost_from, "training loop", bucket_colour(EFFECTIVE), "training loop")
        bar(lane, lost_from, tl.loop_end, LOST, bucket_colour(LOST), "steps after the last committed checkpoint")
    if tl.train_end is not None:
        bar(lane, tl.train_end, tl.end, SHUTDOWN, bucket_colour(SHUTDOWN), "shutdown")
    if tl.recovery_after:
        bar(lane, *tl.recovery_after, RECOVERY, bucket_colour(RECOVERY), "after the failure")


def _markers(fig, tl: AttemptTimeline, lane: str, t0: float, legend_seen: set[str]) -> None:
    import plotly.graph_objects as go

    groups = [
        ("steps", [ts for ts, _ in tl.steps], [f"step {n}" for _, n in tl.steps],
         {"symbol": "line-ns-open", "size": 9, "color": "#1b5e20"}),
        ("checkpoint committed", [ts for ts, _ in tl.checkpoints], [f"checkpoint of step {n}" for _, n in tl.checkpoints],
         {"symbol": "diamond", "size": 11, "color": "#ff7f0e", "line": {"width": 1, "color": "black"}}),
    ]
    if tl.failure:
        groups.append(("failure", [tl.failure["ts"]],
                       [html.escape(f"{tl.failure['category']}: {tl.failure['reason']}")],
                       {"symbol": "x", "size": 14, "color": "#d62728", "line": {"width": 1, "color": "black"}}))
    for name, xs, texts, marker in groups:
        if not xs:
            continue
        fig.add_trace(go.Scatter(x=[x - t0 for x in xs], y=[lane] * len(xs), mode="markers", name=name,
                                 legendgroup=name, showlegend=name not in legend_seen, marker=marker,
                                 text=texts, hovertemplate="%{text} at %{x:.3f} s<extra></extra>"))
        legend_seen.add(name)


def _breakdown_figure(result: RunResult):
    import plotly.graph_objects as go

    names = [n for n, s in result.buckets.items() if s > 0]
    fig = go.Figure()
    for name in names:  # one stacked bar per attempt plus the whole job
        ys = ["job"] + [f"attempt {a.attempt}" for a in result.attempts]
        xs = [result.buckets[name]] + [a.buckets.get(name, 0.0) for a in result.attempts]
        hover = html.escape(f"{name} ({bucket_label(name)})")
        fig.add_trace(go.Bar(y=ys, x=xs, name=name, orientation="h", marker_color=bucket_colour(name),
                             hovertemplate=f"{hover}: %{{x:.3f}} s<extra></extra>"))
    fig.update_layout(title=_title("breakdown (seconds; the bars sum to end-to-end)"), barmode="stack",
                      template="plotly_white", height=196 + 40 * (len(result.attempts) + 1),
                      yaxis={"autorange": "reversed"}, legend={"orientation": "h", "y": -0.3},
                      margin={"l": 100, "r": 20, "t": _TOP_MARGIN, "b": 40})
    return fig


def _windows_figure(windows: Sequence[Window | FleetWindow],
                    title: str = "ETT% per window (bars: each window's buckets, % of its counted time)"):
    """Each window as a bar of its buckets (% of its counted time) under a line of ETT% per window."""
    import datetime as dt

    import plotly.graph_objects as go

    # Bars sit at each window's middle and span its length (ms on a date axis), so a short last
    # window is drawn short; times are local, as in the terminal table.
    mids = [dt.datetime.fromtimestamp((w.since + w.until) / 2) for w in windows]
    widths = [(w.until - w.since) * 1000 for w in windows]
    totals = [sum(w.buckets.values()) for w in windows]
    names = [n for n in (windows[0].buckets if windows else {}) if any(w.buckets.get(n, 0) > 0 for w in windows)]
    fig = go.Figure()
    for name in names:
        hover = html.escape(f"{name} ({bucket_label(name)})")
        fig.add_trace(go.Bar(
            x=mids, y=[100 * w.buckets.get(name, 0.0) / t if t > 0 else 0 for w, t in zip(windows, totals)],
            width=widths, name=name, marker_color=bucket_colour(name), opacity=0.55,
            hovertemplate=f"{hover}: %{{y:.1f}}%<extra></extra>"))
    fig.add_trace(go.Scatter(
        x=mids, y=[w.ett_pct for w in windows], mode="lines+markers", name="ETT%", connectgaps=False,
        line={"color": "#1b5e20", "width": 3}, marker={"size": 7},
        text=[f"{format_time(w.since)} + {format_duration(w.until - w.since)}" for w in windows],
        hovertemplate="ETT %{y:.1f}%<br>%{text}<extra></extra>"))
    fig.update_layout(title=_title(title), barmode="stack", template="plotly_white", height=396, bargap=0,
                      yaxis={"title": "% of counted time", "range": [0, 100]}, xaxis={"type": "date"},
                      legend={"orientation": "h", "y": -0.25}, margin={"l": 60, "r": 20, "t": _TOP_MARGIN, "b": 40})
    return fig


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], css_class: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' class="{css_class}"' if css_class else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _slow_steps_html(result: RunResult) -> str:
    slow = result.slow_steps
    if slow is None or slow.ideal_step_s is None:
        return ""
    steps = _html_table(("attempt", "step", "duration", "over ideal"), [
        (s.attempt, f"{s.step:,}", _step_time(s.duration_s), _step_time(s.excess_s)) for s in slow.slowest_steps])
    ranks = ""
    if slow.slowest_ranks:
        ranks = "<div><h3>Stragglers</h3>" + _html_table(("rank", "lagged steps", "total lag", "worst steps"), [
            (r.rank, f"{r.lagged_steps:,}", format_duration(r.lag_s),
             ", ".join(f"{lag.attempt}/{lag.step}: {_step_time(lag.lag_s)}" for lag in r.worst[:5]))
            for r in slow.slowest_ranks]) + "</div>"
    return (f'<div class="slow"><h3>Slow steps</h3><p>{html.escape(_slow_summary(result))}</p>'
            f'<div class="tables"><div>{steps}</div>{ranks}</div></div>')


def _run_section(result: RunResult, index: int) -> str:
    e2e = result.e2e_s
    l1_rows = [(label, format_duration(result.l1[key]), _pct(result.l1[key], e2e)) for key, label in _L1_LABELS]
    l1_rows.append(("failures", result.l1["failures"],
                    ", ".join(f"{k} {v}" for k, v in result.l1["failures_by_category"].items())))
    l2_rows = [(name, f"{s:,.3f}", _pct(s, e2e), bucket_label(name))
               for name, s in result.buckets.items() if s > 0]
    timeline = _plot_div(_timeline_figure(result), f"timeline-{index}")
    breakdown = _plot_div(_breakdown_figure(result), f"breakdown-{index}")
    windows = _plot_div(_windows_figure(result.windows), f"windows-{index}") if result.windows else ""
    warnings_html = "".join(f"<li>{html.escape(w)}</li>" for w in result.warnings)
    return f"""
<section class="run">
  <h2>{html.escape(result.job)} <small>{html.escape(result.run_dir)}</small></h2>
  <div class="headline"><span class="ett">{result.ett_pct:.1f}%</span> ETT
    <span class="facts">end-to-end {format_duration(e2e)} · {result.devices} device(s) ·
    {len(result.attempts)} attempt(s) · {result.l1['failures']} failure(s)</span></div>
  <div class="tables"><div><h3>L1</h3>{_html_table(("figure", "time", "% of e2e"), l1_rows)}</div>
  <div><h3>L2 buckets</h3>{_html_table(("bucket", "seconds", "% of e2e", "what"), l2_rows)}</div></div>
  {_slow_steps_html(result)}
  {breakdown}
  {windows}
  {timeline}
  {f'<ul class="warnings">{warnings_html}</ul>' if warnings_html else ''}
</section>"""


def render_html(results: Sequence[RunResult], title: str = "warmstart ETT report", *,
                intro: Sequence[Sequence[Any]] | None = None) -> str:
    """One self-contained page (plotly.js inlined, no network) with a section per run.

    ``intro``: a table shown above the runs, as rows whose first row is the header (e.g. the
    figures of a benchmark comparing them); cells are escaped.
    """
    sections = (_intro_table(intro) if intro else "") + "".join(_run_section(r, i) for i, r in enumerate(results))
    return _page(title, sections)


def render_fleet_html(fleet: FleetResult, title: str = "warmstart fleet ETT report", *,
                      windows: Sequence[FleetWindow] | None = None, top: int = 30, rows: int = 200) -> str:
    """One self-contained page for a fleet: fleet ETT% and its buckets, fleet ETT% per time window, and
    the jobs that lost the most device-hours, first (a chart of the ``top`` largest, a table of ``rows``).

    ``windows``: the series to chart (default ``fleet.windows``; none: no chart).
    """
    windows = fleet.windows if windows is None else windows
    total = fleet.device_seconds
    facts = (f"{fleet.jobs:,} job(s) · {total / 3600:,.1f} device-hours · {fleet.failures:,} failure(s) · "
             f"weighted by device-seconds")
    bucket_rows = [(name, f"{s / 3600:,.2f}", _pct(s, total), bucket_label(name))
                   for name, s in fleet.to_dict()["buckets"].items() if s > 0]
    parts = [f'<div class="headline"><span class="ett">{fleet.ett_pct:.1f}%</span> fleet ETT '
             f'<span class="facts">{html.escape(facts)}</span></div>',
             f'<div class="tables"><div><h3>Buckets</h3>'
             f'{_html_table(("bucket", "device-hours", "% of total", "what"), bucket_rows)}</div></div>']
    if windows:
        every = windows[0].until - windows[0].since
        parts.append(f"<h2>Over time</h2><p>{len(windows):,} windows of {html.escape(format_duration(every))} "
                     f"(local time)</p>")
        parts.append(_plot_div(_windows_figure(
            windows, "fleet ETT% per window (bars: each window's buckets, % of its device-time)"), "fleet-windows"))
    ranked = _jobs_by_loss(fleet)
    if ranked:
        shown = min(rows, len(ranked))
        parts.append(f"<h2>Jobs by lost device-hours</h2><p>{shown:,} of {len(ranked):,} job(s), the largest "
                     f"loss first; lost = every bucket but {EFFECTIVE}.</p>")
        parts.append(_plot_div(_job_losses_figure(ranked[:top]), "fleet-jobs"))
        parts.append(_html_table(
            ("#", "job", "devices", "wall", "ETT%", "lost device-hours", "largest loss", "failures", "run dir"),
            [(n, run["job"], run["devices"], format_duration(run["e2e_s"]), f"{run['ett_pct']:.1f}",
              f"{lost / 3600:,.2f}", _largest_loss(buckets), run["failures"], run["run_dir"])
             for n, (run, buckets, lost) in enumerate(ranked[:rows], 1)], css_class="jobs"))
    return _page(title, f'<section class="fleet">{"".join(parts)}</section>')


def _jobs_by_loss(fleet: FleetResult) -> list[tuple[dict[str, Any], dict[str, float], float]]:
    """(run row, its buckets in device-seconds, lost device-seconds) per job, the largest loss first."""
    ranked = [(run, buckets, sum(s for name, s in buckets.items() if name != EFFECTIVE))
              for run, buckets in zip(fleet.runs, fleet.run_buckets)]
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
        fig.add_trace(go.Bar(
            y=labels, x=[buckets.get(name, 0.0) / 3600 for _, buckets, _ in ranked], name=name, orientation="h",
            marker_color=bucket_colour(name), text=[html.escape(run["run_dir"]) for run, _, _ in ranked],
            textposition="none", hovertemplate=f"{hover}: %{{x:,.2f}} device-hours<br>%{{text}}<extra></extra>"))
    fig.update_layout(title=_title("lost device-hours per job, by bucket"), barmode="stack",
                      template="plotly_white", height=_TOP_MARGIN + 120 + 26 * len(ranked),
                      xaxis_title="device-hours", yaxis={"autorange": "reversed", "type": "category"},
                      legend={"traceorder": "normal"}, margin={"l": 200, "r": 20, "t": _TOP_MARGIN, "b": 40})
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
.headline {{ margin: 0.5em 0 1em; }} .ett {{ font-size: 3em; font-weight: bold; color: #2ca02c; }}
.facts {{ color: #666; margin-left: 1em; }}
.tables {{ display: flex; gap: 3em; flex-wrap: wrap; }}
table {{ border-collapse: collapse; }} th, td {{ padding: 2px 10px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }} thead {{ border-bottom: 1px solid #aaa; }}
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


def results_json(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """The ``warmstart ett report --json`` payload: one object per run."""
    return [r.to_dict() for r in results]
