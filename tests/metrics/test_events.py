"""The event reader: its fast (whole-file) path agrees with the line-by-line reference check."""

from __future__ import annotations

import json

from _timelines import ev, span
from warmstart.metrics.events import Event, _read_lines, read_events, write_events


def test_fast_path_equals_line_by_line_reference(tmp_path):
    events = [ev(0, "attempt_start", devices=2), *span(0, 1, "compile"), *span(1, 2, "x", bucket="eval"),
              ev(2, "step", step=0, samples=3), ev(3, "step", step=1), ev(4, "checkpoint_committed", step=1),
              ev(5, "failure", reason="r", category="user"), ev(6, "train_end"), ev(7, "attempt_end", rank=-1)]
    path = tmp_path / "e.jsonl"
    write_events(path, events)
    fast = read_events(path)
    assert fast == _read_lines(path, path.read_bytes().split(b"\n"))
    assert [e.to_dict() for e in fast] == events


def test_unusual_but_valid_lines_are_accepted(tmp_path):
    path = tmp_path / "e.jsonl"
    lines = [
        {"ts": 1700000000, "job": "j", "attempt": 0.0, "rank": 0, "event": "step", "step": 3.0},  # ints as floats
        {"ts": 1700000001.5, "job": "j", "attempt": 0, "rank": 0, "event": "failure", "category": "infra"},
        {"ts": 1700000002.0, "job": "j", "attempt": 0, "rank": 0, "event": "train_end", "note": "extra field"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    got = read_events(path)
    assert got[0] == Event(1700000000.0, "j", 0, 0, "step", step=3)
    assert (got[1].reason, got[1].category) == ("", "infra")
    assert got[2].event == "train_end" and len(got) == 3
