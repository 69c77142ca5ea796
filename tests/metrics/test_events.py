"""The event schema: its fast (whole-file) path agrees with the line-by-line reader, bad lines are
worded, and what is written is what is read."""

from __future__ import annotations

import json

import pytest
from _timelines import ev, span

from warmstart.metrics.events import Failure, Step, _read_lines, _TornLines, parse_event, read_events, write_events


def test_fast_path_equals_line_by_line_reference(tmp_path):
    events = [
        ev(0, "attempt_start", devices=2),
        *span(0, 1, "compile"),
        *span(1, 2, "x", bucket="eval"),
        ev(2, "step", step=0, samples=3),
        ev(3, "step", step=1),
        ev(4, "checkpoint_committed", step=1),
        ev(5, "failure", reason="r", category="user"),
        ev(6, "train_end"),
        ev(7, "attempt_end", rank=-1),
    ]
    path = tmp_path / "e.jsonl"
    write_events(path, events)
    fast = read_events(path)
    raw = path.read_bytes().split(b"\n")
    assert fast == _read_lines(path, raw, _TornLines(path)) == [parse_event(json.loads(line)) for line in raw if line]
    assert [e.to_dict() for e in fast] == events
    assert [e.event for e in fast] == [e["event"] for e in events]


def test_a_failure_always_writes_its_reason_and_optional_fields_are_left_out(tmp_path):
    path = tmp_path / "e.jsonl"
    write_events(path, [Failure(1.0, "j", 0, 0, "user"), Step(2.0, "j", 0, 0, 5)])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"ts": 1.0, "job": "j", "attempt": 0, "rank": 0, "event": "failure", "category": "user", "reason": ""},
        {"ts": 2.0, "job": "j", "attempt": 0, "rank": 0, "event": "step", "step": 5},
    ]


@pytest.mark.parametrize(
    "bad, problem",
    [
        (Step(1.0, "j", 0, 0, "x"), "event 1: field 'step' must be an integer, got 'x'"),  # type: ignore[arg-type]
        (ev(1, "begin", span=""), "event 1: field 'span' must be a non-empty string, got ''"),
        (ev(1, "failure", category="cosmic"), "event 1: field 'category' must be one of infra, preemption, user"),
    ],
)
def test_writing_an_invalid_event_is_refused_and_writes_nothing(tmp_path, bad, problem):
    path = tmp_path / "e.jsonl"
    with pytest.raises(ValueError, match=problem):
        write_events(path, [ev(0, "train_end"), bad])
    assert not path.exists()


def test_unusual_but_valid_lines_are_accepted(tmp_path):
    path = tmp_path / "e.jsonl"
    lines = [
        {"ts": 1700000000, "job": "j", "attempt": 0.0, "rank": 0, "event": "step", "step": 3.0},  # ints as floats
        {"ts": 1700000001.5, "job": "j", "attempt": 0, "rank": 0, "event": "failure", "category": "infra"},
        {"ts": 1700000002.0, "job": "j", "attempt": 0, "rank": 0, "event": "train_end", "note": "extra field"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    got = read_events(path)
    assert got[0] == Step(1700000000.0, "j", 0, 0, step=3)
    assert (got[1].reason, got[1].category) == ("", "infra")
    assert got[2].event == "train_end" and len(got) == 3


# -- torn lines: fragments of interrupted writes, anywhere in a file ------------------------------------

import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from _timelines import T0  # noqa: E402

from warmstart.metrics.events import EventFormatError, TornLineWarning  # noqa: E402

_EVENTS = [
    ev(0, "attempt_start", devices=2),
    ev(10, "step", step=0),
    ev(20, "checkpoint_committed", step=0),
    ev(30, "step", step=1),
    ev(40, "train_end"),
    ev(50, "attempt_end"),
]
_FRAGMENT = '{"ts": 1700000025.0, "job": "job-1", "attempt": 0, "ra'  # a writer killed mid-line


def _lines(events) -> list[str]:
    return [json.dumps(e) for e in events]


def _read_warned(path) -> tuple[list, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = read_events(path)
    return [e.to_dict() for e in events], [str(w.message) for w in caught if w.category is TornLineWarning]


def test_torn_line_in_the_middle_is_skipped_with_file_and_line(tmp_path):
    path = tmp_path / "events-r0-a0.jsonl"
    lines = _lines(_EVENTS)
    path.write_text("\n".join(lines[:3] + [_FRAGMENT] + lines[3:]) + "\n")
    got, warned = _read_warned(path)
    assert got == _EVENTS
    assert warned == [f"{path}:4: torn line skipped (a fragment of an interrupted write)"]


def test_torn_last_line_is_still_skipped(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text("\n".join(_lines(_EVENTS)) + "\n" + _FRAGMENT)
    got, warned = _read_warned(path)
    assert got == _EVENTS
    assert warned == [f"{path}:7: torn last line skipped (the writer died mid-write)"]


def test_two_fragments_and_a_tail_piece(tmp_path):
    """A short write retried after another writer appended leaves the head glued to that writer's
    line and the tail on a line of its own."""
    path = tmp_path / "e.jsonl"
    lines = _lines(_EVENTS)
    path.write_text(
        "\n".join([lines[0], _FRAGMENT, lines[1], '"rank": 0, "event": "step", "step": 7}', *lines[2:], _FRAGMENT])
    )
    got, warned = _read_warned(path)
    assert got == _EVENTS
    assert warned == [
        f"{path}:2: torn line skipped (a fragment of an interrupted write)",
        f"{path}:4: torn line skipped (a fragment of an interrupted write)",
        f"{path}:9: torn last line skipped (the writer died mid-write)",
    ]


def test_fragment_glued_to_a_valid_line_keeps_the_event(tmp_path):
    path = tmp_path / "e.jsonl"
    lines = _lines(_EVENTS)
    path.write_text("\n".join(lines[:2] + [_FRAGMENT + lines[2], _FRAGMENT + _FRAGMENT + lines[3]] + lines[4:]) + "\n")
    got, warned = _read_warned(path)
    assert got == _EVENTS  # the checkpoint and the step after the fragments are kept
    assert warned == [
        f"{path}:{n}: torn fragment skipped before the event on this line (a write cut short before "
        "its newline); the event was kept"
        for n in (3, 4)
    ]
    # A glued last line without its newline too.
    path.write_text("\n".join(lines[:-1] + [_FRAGMENT + lines[-1]]))
    got, warned = _read_warned(path)
    assert got == _EVENTS and len(warned) == 1 and f"{path}:6: torn fragment" in warned[0]


def test_warnings_per_file_are_bounded(tmp_path):
    path = tmp_path / "e.jsonl"
    lines = _lines(_EVENTS)
    path.write_text("\n".join([lines[0]] + [_FRAGMENT] * 12 + lines[1:]) + "\n")
    got, warned = _read_warned(path)
    assert got == _EVENTS
    assert len(warned) == 6
    assert warned[-1] == f"{path}:7: 7 more torn lines skipped (lines 7, 8, 9, 10, 11, 12, 13)"


@pytest.mark.parametrize(
    "bad, problem",
    [
        ('{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": 0, "event": "stepp", "step": 1}', "field 'event'"),
        ('{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": 0, "event": "step"}', "missing field 'step'"),
        ("[1, 2]", "expected a JSON object"),
        (
            '{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": 0, "event": "step", "step": 1.5}',
            r"field 'step' must be an integer, got 1\.5",
        ),
        (
            '{"ts": Infinity, "job": "j", "attempt": 0, "rank": 0, "event": "train_end"}',
            "field 'ts' must be a finite number, got inf",
        ),
        (
            '{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": 0, "event": "step", "step": 1, "samples": -2}',
            "field 'samples' must be >= 0, got -2",
        ),
        (
            '{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": 0, "event": "begin", "span": "x", "bucket": 3}',
            "field 'bucket' must be a string, got 3",
        ),
        (
            '{"ts": 1700000001.0, "job": "j", "attempt": 0, "rank": -2, "event": "train_end"}',
            "field 'rank' must be >= -1, got -2",
        ),
    ],
)
def test_a_complete_line_that_breaks_the_schema_is_still_an_error(tmp_path, bad, problem):
    path = tmp_path / "e.jsonl"
    lines = _lines(_EVENTS)
    path.write_text("\n".join([lines[0], _FRAGMENT, lines[1], bad] + lines[2:]) + "\n")
    with pytest.raises(EventFormatError, match=rf"e.jsonl:4: .*{problem}"):
        _read_warned(path)


def _write_two_ranks(run_dir: Path) -> tuple[Path, Path]:
    r0, r1 = run_dir / "events-r0-a0.jsonl", run_dir / "events-r1-a0.jsonl"
    write_events(
        r0,
        [
            ev(0, "attempt_start", devices=2, rank=-1),
            *span(0, 10, "compile"),
            ev(10, "step", step=0),
            ev(30, "step", step=1),
            ev(90, "train_end"),
            ev(100, "attempt_end", rank=-1),
        ],
    )
    write_events(r1, [*span(0, 12, "compile", rank=1), ev(12, "step", step=0, rank=1), ev(90, "train_end", rank=1)])
    return r0, r1


def test_report_cli_skips_fragments_and_names_them(tmp_path):
    """`warmstart ett report` used to exit with an error on one fragment in the middle of a rank's file."""
    run = tmp_path / "job-1"
    run.mkdir()
    r0, r1 = _write_two_ranks(run)
    expected = subprocess.run(
        [Path(sys.executable).parent / "warmstart", "ett", "report", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert expected.returncode == 0, expected.stderr
    for path in (r0, r1):  # one fragment in the middle of each rank's file, another glued to rank 1's line
        lines = path.read_text().splitlines()
        lines.insert(2, _FRAGMENT)
        path.write_text("\n".join(lines) + "\n")
    lines = r1.read_text().splitlines()
    lines[4] = _FRAGMENT + lines[4]
    r1.write_text("\n".join(lines) + "\n" + _FRAGMENT)
    result = subprocess.run(
        [Path(sys.executable).parent / "warmstart", "ett", "report", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (got,) = json.loads(result.stdout)
    (want,) = json.loads(expected.stdout)
    assert got["e2e_s"] == pytest.approx(100) and got["ett_pct"] == pytest.approx(want["ett_pct"])
    assert got["buckets"] == pytest.approx(want["buckets"]) and got["l1"] == want["l1"]
    for where in (f"{r0}:3: torn line", f"{r1}:3: torn line", f"{r1}:5: torn fragment", f"{r1}:6: torn last line"):
        assert f"warmstart: warning: {where}" in result.stderr, result.stderr
    assert got["end_ts"] > T0


def test_report_cli_still_exits_2_on_a_malformed_event(tmp_path):
    run = tmp_path / "job-1"
    run.mkdir()
    r0, _ = _write_two_ranks(run)
    lines = r0.read_text().splitlines()
    lines.insert(3, '{"ts": 1700000005.0, "job": "job-1", "attempt": 0, "rank": 0, "event": "step", "step": "x"}')
    r0.write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [Path(sys.executable).parent / "warmstart", "ett", "report", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert f"{r0}:4: field 'step' must be an integer" in result.stderr


def test_torn_files_read_the_same_as_the_line_by_line_reader(tmp_path):
    path = tmp_path / "e.jsonl"
    lines = _lines(_EVENTS)
    path.write_text("\n".join([lines[0], _FRAGMENT, "", lines[1], _FRAGMENT + lines[2], *lines[3:]]) + "\n")
    raw = path.read_bytes().split(b"\n")
    torn = _TornLines(path)
    with pytest.warns(TornLineWarning):
        whole = read_events(path)
    assert _read_lines(path, raw, torn) == whole
    assert [e.to_dict() for e in whole] == _EVENTS
    assert torn.lines == [
        (2, "torn line skipped (a fragment of an interrupted write)"),
        (
            5,
            "torn fragment skipped before the event on this line (a write cut short before its newline); "
            "the event was kept",
        ),
    ]


# -- torn or not: what a fragment of an interrupted write looks like ---------------------------------------

from warmstart.metrics.events import is_fragment  # noqa: E402


@pytest.mark.parametrize(
    "text",
    [
        '{"ts": 1700000025.0, "job": "job-1", "attempt": 0, "ra',  # a start cut inside a key
        '{"ts": 17',  # inside a number
        '{"ts": 1700000025.',
        '{"ts": 1700000025.0, "job": "job-1", "attempt": 0, "rank": 0, "event": "failure", "reason": "NCC',
        '{"a": tr',
        '{"ts": 1, "ra{"ts": 2, "job"',  # two starts glued together
        '"rank": 0, "event": "step", "step": 7}',  # the end of a retried write, from a key
        'nk": 0, "event": "step", "step": 7}',  # from inside a key
        ': 0, "event": "step", "step": 7}',  # from its colon
        '0, "event": "step", "step": 7}',  # from a value
        'out", "category": "infra"}',  # from inside a string value
        "}",
    ],
)
def test_pieces_of_an_event_line_are_fragments(text):
    assert is_fragment(text) and is_fragment(text.encode())


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "# a comment",
        "ts,job,attempt",
        "{hello}",
        "{}x",
        "hello}",
        "[1, 2",
        'hello {"ts": 1700000000.0, "job": "j", "attempt": 0, "rank": 0, "event": "train_end"}',
    ],
)
def test_other_text_is_no_fragment(text):
    assert not is_fragment(text)


def test_text_glued_before_an_event_is_an_error_not_a_torn_fragment(tmp_path):
    path = tmp_path / "e.jsonl"
    lines = _lines(_EVENTS)
    path.write_text("\n".join([lines[0], "garbage " + lines[1], *lines[2:]]) + "\n")
    with pytest.raises(EventFormatError, match=r"e.jsonl:2: not an event: 'garbage "):
        _read_warned(path)
