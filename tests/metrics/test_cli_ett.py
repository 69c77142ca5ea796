"""``warmstart ett report|fleet|interval``: exit codes, stable ``--json`` keys, human tables."""

from __future__ import annotations

import json
import math

import pytest
from _timelines import T0, ev, span
from click.testing import CliRunner

from warmstart.cli import cli
from warmstart.metrics.events import write_events

L1_KEYS = {"time_to_start_s", "time_to_recover_s", "failures", "lost_progress_s", "checkpoint_blocking_s", "shutdown_s"}


def _write_run(run_dir, job="job-1", devices=2, scale=1.0):
    write_events(
        run_dir / "events-r0-a0.jsonl",
        [
            ev(0, "attempt_start", job=job, devices=devices),
            *span(0, 10 * scale, "compile", job=job),
            ev(10 * scale, "step", job=job, step=0),
            ev(20 * scale, "checkpoint_committed", job=job, step=0),
            ev(30 * scale, "step", job=job, step=1),
            ev(40 * scale, "failure", job=job, reason="x", category="infra"),
        ],
    )
    write_events(
        run_dir / "events-r0-a1.jsonl",
        [
            ev(50 * scale, "attempt_start", attempt=1, job=job, devices=devices),
            ev(55 * scale, "step", attempt=1, job=job, step=1),
            ev(95 * scale, "train_end", attempt=1, job=job),
            ev(100 * scale, "attempt_end", attempt=1, job=job),
        ],
    )


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_report_json_has_the_reference_keys(tmp_path):
    _write_run(tmp_path)
    result = _invoke("ett", "report", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)
    assert {"job", "e2e_s", "ett_pct", "buckets", "l1", "attempts"} <= set(run)
    assert set(run["l1"]) >= L1_KEYS
    assert math.isclose(sum(run["buckets"].values()), run["e2e_s"], abs_tol=1e-6)
    assert run["e2e_s"] == pytest.approx(100)
    # effective: step 0 [10,30) + step 1 of attempt 1 [55,95); lost: step 1 of attempt 0 [30,40)
    assert run["buckets"]["effective_training"] == pytest.approx(60)
    assert run["ett_pct"] == pytest.approx(60)
    assert run["l1"]["lost_progress_s"] == pytest.approx(10)
    assert run["l1"]["time_to_recover_s"] == pytest.approx(10 + 5)
    assert [a["attempt"] for a in run["attempts"]] == [0, 1]
    assert {"e2e_s", "ett_pct", "buckets", "lost_progress_s", "failed"} <= set(run["attempts"][0])


def test_report_table_is_readable(tmp_path):
    _write_run(tmp_path)
    result = _invoke("ett", "report", str(tmp_path))
    assert result.exit_code == 0
    out = result.stdout
    assert "ETT  60.0%" in out
    for label in (
        "time to start",
        "time to recover",
        "lost progress",
        "checkpoint blocking",
        "shutdown",
        "effective_training",
        "recovery_wait",
        "end-to-end",
    ):
        assert label in out


def test_report_several_runs_and_html(tmp_path):
    _write_run(tmp_path / "a", job="a")
    _write_run(tmp_path / "b", job="b")
    page = tmp_path / "report.html"
    result = _invoke("ett", "report", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--html", str(page))
    assert result.exit_code == 0
    assert [r["job"] for r in json.loads(result.stdout)] == ["a", "b"]
    text = page.read_text()
    assert "https://" not in text.split("<script")[0] and 'src="http' not in text  # nothing fetched
    assert text.count('id="timeline-') == 2 and text.count('id="breakdown-') == 2


def test_malformed_input_exits_2_naming_file_and_line(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"ts": 1, "job": "j", "attempt": 0, "rank": 0, "event": "nope"}\n{}\n')
    result = CliRunner().invoke(cli, ["ett", "report", str(tmp_path)])
    assert result.exit_code == 2
    assert "events.jsonl:1:" in result.stderr and "field 'event'" in result.stderr
    result = CliRunner().invoke(cli, ["ett", "report", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "not a run directory" in result.stderr


def test_torn_line_warns_on_stderr_and_still_reports(tmp_path):
    _write_run(tmp_path)
    with (tmp_path / "events-r0-a1.jsonl").open("a") as f:
        f.write('{"ts": 17')
    result = _invoke("ett", "report", str(tmp_path), "--json")
    assert result.exit_code == 0
    assert "torn last line" in result.stderr
    assert json.loads(result.stdout)[0]["e2e_s"] == pytest.approx(100)


def test_fleet_weights_by_device_seconds(tmp_path):
    _write_run(tmp_path / "small", job="small", devices=1)  # ETT 60% over 100 s on 1 device
    write_events(
        tmp_path / "big" / "events.jsonl",
        [  # ETT 90% over 100 s on 9 devices
            ev(0, "attempt_start", job="big", devices=9),
            ev(10, "step", job="big", step=0),
            ev(100, "train_end", job="big"),
            ev(100, "attempt_end", job="big"),
        ],
    )
    result = _invoke("ett", "fleet", str(tmp_path / "small"), str(tmp_path / "big"), "--json")
    assert result.exit_code == 0
    fleet = json.loads(result.stdout)
    assert fleet["ett_pct"] == pytest.approx((60 * 1 + 90 * 9) / (100 * 1 + 100 * 9) * 100)
    assert fleet["jobs"] == 2 and fleet["device_seconds"] == pytest.approx(1000)
    assert math.isclose(sum(fleet["buckets"].values()), fleet["device_seconds"], abs_tol=1e-6)
    text = _invoke("ett", "fleet", str(tmp_path)).stdout  # one directory holding both jobs
    assert "fleet ETT  87.0%" in text and "big" in text and "small" in text


def test_interval_json_and_formula():
    result = _invoke("ett", "interval", "--blocking", "30", "--failures-per-day", "2", "--json")
    assert result.exit_code == 0
    out = json.loads(result.stdout)
    mtbf = 86400 / 2
    assert out["interval_s"] == pytest.approx(math.sqrt(2 * mtbf * 30))
    assert out["waste_pct"] == pytest.approx(100 * math.sqrt(2 * 30 / mtbf))
    assert out["waste_pct"] == pytest.approx(out["blocked_pct"] + out["lost_pct"])
    table = _invoke("ett", "interval", "--blocking", "30", "--failures-per-day", "2", "--current", "3600").stdout
    assert "advised interval" in table and "26m 50s" in table and "5.00%" in table


@pytest.mark.parametrize(
    "args, named",
    [
        (["--blocking", "0", "--failures-per-day", "2"], "'--blocking': '0' is not a duration"),
        (["--blocking", "5", "--failures-per-day", "-1"], "--failures-per-day=-1.0"),
    ],
)
def test_interval_rejects_bad_values_with_exit_2(args, named):
    result = CliRunner().invoke(cli, ["ett", "interval", *args])
    assert result.exit_code == 2
    assert named in result.stderr and "expected a positive" in result.stderr


# -- inputs that are not runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["report", "fleet", "project"])
@pytest.mark.parametrize(
    "contents, why",
    [
        ({}, "it holds no *.jsonl files"),
        ({"notes.txt": "hello world\n"}, "it holds no *.jsonl files"),
        ({"events.jsonl": "\n\n"}, "its *.jsonl files hold no events"),
    ],
)
def test_a_directory_without_events_is_bad_input(tmp_path, command, contents, why):
    run = tmp_path / "run"
    run.mkdir()
    for name, text in contents.items():
        (run / name).write_text(text)
    result = CliRunner().invoke(cli, ["ett", command, str(run)])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert "no ETT events" in line and (why in line or command == "fleet"), result.stderr


def test_a_fleet_leaves_out_directories_without_events(tmp_path):
    _write_run(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    result = _invoke("ett", "fleet", str(tmp_path / "good"), str(tmp_path / "empty"), "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["jobs"] == 1
    assert f"{tmp_path / 'empty'}: no ETT events: it holds no *.jsonl files" in result.stderr


@pytest.mark.parametrize(
    "text, line",
    [
        ("hello world\n", 2),  # text, not a fragment of an event line
        ("hello world", 2),  # the same without its newline at the end of the file
        ("# ts job attempt rank event\n", 2),
        ('hello {"ts": 1700000000.0, "job": "job-1", "attempt": 0, "rank": 0, "event": "train_end"}\n', 2),
    ],
)
def test_text_that_is_no_fragment_is_an_error_naming_file_and_line(tmp_path, text, line):
    good = json.dumps(ev(0, "attempt_start"))
    (tmp_path / "events.jsonl").write_text(good + "\n" + text)
    result = CliRunner().invoke(cli, ["ett", "report", str(tmp_path)])
    assert result.exit_code == 2 and result.stdout == ""
    assert f"{tmp_path / 'events.jsonl'}:{line}: not an event" in result.stderr
    assert "no fragment of an interrupted write" in result.stderr


def test_a_missing_directory_is_named_without_a_line(tmp_path):
    result = CliRunner().invoke(cli, ["ett", "report", str(tmp_path / "nonexistent")])
    assert result.exit_code == 2
    assert f"{tmp_path / 'nonexistent'}: not a run directory" in result.stderr
    assert ":0:" not in result.stderr


def test_a_window_without_counted_time_has_no_ett_whichever_option_cuts_it(tmp_path):
    _write_run(tmp_path)  # T0 .. T0 + 100
    since, until = str(T0 + 200), str(T0 + 300)
    (restricted,) = json.loads(
        _invoke("ett", "report", str(tmp_path), "--since", since, "--until", until, "--json").stdout
    )
    assert restricted["e2e_s"] == 0 and restricted["ett_pct"] is None
    (sliced,) = json.loads(
        _invoke(
            "ett", "report", str(tmp_path), "--since", str(T0), "--until", until, "--every", "100s", "--json"
        ).stdout
    )
    assert [w["ett_pct"] for w in sliced["windows"]][1:] == [None, None]
    assert "ETT      -" in _invoke("ett", "report", str(tmp_path), "--since", since, "--until", until).stdout
    fleet = json.loads(_invoke("ett", "fleet", str(tmp_path), "--since", since, "--until", until, "--json").stdout)
    assert fleet["jobs"] == 0 and fleet["ett_pct"] is None


def test_report_tables_fit_80_columns(tmp_path):
    import io

    from rich.console import Console

    from warmstart.metrics.calculator import compute, load_runs
    from warmstart.metrics.report import print_run
    from warmstart.metrics.windows import TimeFilter, apply

    _write_run(tmp_path)
    write_events(tmp_path / "events-r1-a0.jsonl", [ev(10, "step", rank=1, step=0), ev(30.5, "step", rank=1, step=1)])
    with (tmp_path / "events-r0-a0.jsonl").open("a") as f:  # a long reason, as NCCL gives them
        f.write(
            json.dumps(
                ev(
                    39,
                    "failure",
                    reason="NCCL watchdog: collective operation ALLREDUCE on rank 3 timed out after 600000 ms",
                    category="infra",
                )
            )
            + "\n"
        )
    result = apply(compute(load_runs([tmp_path])[0], segments=True), TimeFilter(every=30))

    def lines(width: int) -> list[str]:
        out = io.StringIO()
        print_run(result, Console(file=out, width=width, soft_wrap=False))
        return out.getvalue().splitlines()

    narrow, wide = lines(80), lines(200)
    assert max(map(len, narrow)) <= 80
    assert len(narrow) == len(wide)  # no row wrapped onto a second line
    assert any("ALLREDUCE" in line for line in wide) and any("infra: NCCL" in line for line in narrow)


def test_report_names_forked_attempts(tmp_path):
    """A process a preloader forked records its launch as a ``preload_handover`` span (bucket
    ``process_launch``): the report says which attempts were forked, the JSON has ``forked``."""
    import json

    from click.testing import CliRunner

    from warmstart.cli import cli

    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for attempt, forked in ((0, False), (1, True)):
        t = 100.0 * attempt
        span = "preload_handover" if forked else "process_launch"
        extra = {"bucket": "process_launch"} if forked else {}
        lines += [
            {"ts": t, "event": "attempt_start"},
            {"ts": t + 1, "event": "begin", "span": span, **extra},
            {"ts": t + 2, "event": "end", "span": span, **extra},
            {"ts": t + 3, "event": "step", "step": 0},
        ]
        lines.append(
            {"ts": t + 50, "event": "failure", "reason": "x", "category": "infra"}
            if attempt == 0
            else {"ts": t + 50, "event": "train_end"}
        )
    (run / "events.jsonl").write_text(
        "".join(
            json.dumps({"job": "j", "attempt": a, "rank": 0, **e}) + "\n"
            for a, e in [(0, x) for x in lines[:5]] + [(1, x) for x in lines[5:]]
        )
    )
    out = CliRunner().invoke(cli, ["ett", "report", str(run)])
    assert out.exit_code == 0, out.output
    assert "forked from a preloader (no new interpreter): attempt 1" in out.output
    data = json.loads(CliRunner().invoke(cli, ["ett", "report", str(run), "--json"]).output)
    runs = data if isinstance(data, list) else data.get("runs", [data])
    assert [a["forked"] for a in runs[0]["attempts"]] == [False, True]
    assert runs[0]["buckets"]["process_launch"] == 2.0


def test_interval_takes_durations_as_every_does():
    as_number = json.loads(_invoke("ett", "interval", "--blocking", "30", "--failures-per-day", "2", "--json").stdout)
    as_duration = _invoke(
        "ett", "interval", "--blocking", "30s", "--failures-per-day", "2", "--current", "1h", "--json"
    )
    assert as_duration.exit_code == 0, as_duration.output
    out = json.loads(as_duration.stdout)
    assert out["interval_s"] == as_number["interval_s"] and out["current_interval_s"] == 3600
    bad = _invoke("ett", "interval", "--blocking", "thirty", "--failures-per-day", "2")
    assert bad.exit_code == 2
    assert bad.stderr.startswith("warmstart: Invalid value for '--blocking': 'thirty' is not a duration: expected")


def test_every_command_s_errors_begin_with_warmstart(tmp_path):
    """One prefix for every error, click's usage errors and ett's bad input included."""
    (tmp_path / "empty").mkdir()
    for args in (
        ("ett", "report", str(tmp_path / "empty")),
        ("ett", "interval", "--blocking", "-1", "--failures-per-day", "2"),
        ("ett", "report", "--since", "yesterday", str(tmp_path / "empty")),
        ("cache", "no-such-command"),
    ):
        result = _invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.startswith("warmstart: ") and "Error:" not in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
