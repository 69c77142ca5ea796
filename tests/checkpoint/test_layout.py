"""The commit protocol on disk: only renamed folders holding the marker count as committed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from warmstart.checkpoint import layout


def _write_partial(root: Path, step: int, session: str = "s1") -> Path:
    partial = layout.partial_path(root, step, session)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"x" * 100)
    (partial / ".metadata").write_bytes(b"m")
    return partial


def test_commit_renames_and_marks(tmp_path: Path) -> None:
    final = layout.commit(_write_partial(tmp_path, 7), 7, world_size=2)
    assert final == layout.final_path(tmp_path, 7) and final.is_dir()
    marker = json.loads((final / layout.MARKER).read_text())
    assert marker["step"] == 7 and marker["world_size"] == 2
    latest = layout.latest_committed(tmp_path)
    assert latest is not None and (latest.step, latest.world_size, latest.path) == (7, 2, final)
    assert not list(tmp_path.glob("*.partial"))


def test_partial_and_unmarked_folders_are_never_committed(tmp_path: Path) -> None:
    layout.commit(_write_partial(tmp_path, 3), 3, world_size=1)
    _write_partial(tmp_path, 6)  # a write still in flight (or killed)
    unmarked = layout.final_path(tmp_path, 9)  # right name, no marker: e.g. copied by hand
    unmarked.mkdir()
    marked_partial = _write_partial(tmp_path, 12)  # crash after the marker, before the rename
    (marked_partial / layout.MARKER).write_text(json.dumps({"step": 12, "world_size": 1}))
    (tmp_path / "step_000000015").write_text("a file, not a folder")
    assert [c.step for c in layout.committed_checkpoints(tmp_path)] == [3]
    assert layout.latest_committed(tmp_path).step == 3  # type: ignore[union-attr]


def test_latest_of_missing_or_empty_directory(tmp_path: Path) -> None:
    assert layout.latest_committed(tmp_path / "nope") is None
    assert layout.latest_committed(tmp_path) is None


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        layout.commit(_write_partial(tmp_path, step), step, world_size=1)
    assert layout.prune(tmp_path, keep=2) == [1, 2]
    assert [c.step for c in layout.committed_checkpoints(tmp_path)] == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["step_000000003", "step_000000004"]


def test_recommitting_a_step_replaces_it(tmp_path: Path) -> None:
    layout.commit(_write_partial(tmp_path, 5, "old"), 5, world_size=1)
    newer = _write_partial(tmp_path, 5, "new")
    (newer / "__0_0.distcp").write_bytes(b"new")
    final = layout.commit(newer, 5, world_size=1)
    assert (final / "__0_0.distcp").read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["step_000000005"]


def test_remove_stale_spares_this_session_and_committed(tmp_path: Path) -> None:
    layout.commit(_write_partial(tmp_path, 1), 1, world_size=1)
    _write_partial(tmp_path, 2, "dead")
    mine = _write_partial(tmp_path, 3, "live")
    (tmp_path / ".step_000000000.123.deleting").mkdir()
    removed = layout.remove_stale(tmp_path, "live")
    assert sorted(removed) == [".step_000000000.123.deleting", layout.partial_path(tmp_path, 2, "dead").name]
    assert mine.is_dir() and layout.latest_committed(tmp_path).step == 1  # type: ignore[union-attr]
