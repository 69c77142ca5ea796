"""Event files on disk: the recorder's file name, listing a run's files, and following a growing file."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmstart.metrics import Recorder
from warmstart.metrics.event_files import LineTail, event_files, file_name, rank_attempt, recorder_files
from warmstart.metrics.events import EventFormatError


def test_the_recorder_writes_the_file_the_name_says(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, job="j", rank=3, attempt=12, flush_interval_s=0)
    rec.step(0)
    rec.close()
    assert rec.path == tmp_path / file_name(3, 12)
    assert rank_attempt(rec.path) == (3, 12)
    assert rank_attempt(tmp_path / file_name(-1, 0)) == (-1, 0)  # job-level writers
    for other in ("events.jsonl", "events-r1.jsonl", "events-r1-a0.json", "xevents-r1-a0.jsonl"):
        assert rank_attempt(tmp_path / other) is None


def test_recorder_files_are_listed_by_rank_then_attempt(tmp_path: Path) -> None:
    assert recorder_files(tmp_path / "missing") == []
    for rank, attempt in ((1, 0), (0, 10), (0, 2), (-1, 0)):
        (tmp_path / file_name(rank, attempt)).write_text("")
    (tmp_path / "events.jsonl").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / file_name(0, 0)).write_text("")
    names = [p.name for p in recorder_files(tmp_path)]
    assert names == [file_name(-1, 0), file_name(0, 2), file_name(0, 10), file_name(1, 0)]
    assert [p.name for p in recorder_files(tmp_path, rank=0)] == [file_name(0, 2), file_name(0, 10)]
    assert len(event_files(tmp_path)) == 6  # every *.jsonl, recursively
    with pytest.raises(EventFormatError, match="not a run directory"):
        event_files(tmp_path / "missing")


def test_a_tail_reads_complete_lines_and_keeps_a_torn_one_for_later(tmp_path: Path) -> None:
    path = tmp_path / file_name(0, 0)
    path.write_bytes(b'{"a": 1}\n{"b"')
    tail = LineTail(path)
    assert tail.read() == (b'{"a": 1}\n', False)
    assert tail.read() == (b"", False)
    with open(path, "ab") as f:
        f.write(b': 2}\n{"c": 3}\n')
    assert tail.read() == (b'{"b": 2}\n{"c": 3}\n', False)
    path.write_bytes(b'{"d": 4}\n')  # replaced by a shorter file: read afresh
    assert tail.read() == (b'{"d": 4}\n', True)
    path.unlink()
    with pytest.raises(OSError):
        tail.read()
