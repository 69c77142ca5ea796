"""The on-disk layout of a checkpoint directory and its commit protocol; plain files, no torch.

A checkpoint of step N is written into ``step_<N>.<session>.partial/``, N in 9 digits
(``step_000000010.<session>.partial/``; every rank writes its DCP files there). Once every rank has finished
writing and DCP's coordinator has written ``.metadata``,
rank 0 writes a ``COMMITTED`` marker (JSON: step, world size, time) into it, fsyncs it, and renames
the folder to ``step_<N>``; the rename is the commit point. A folder is a committed checkpoint only
when its name is ``step_<N>`` *and* it holds the marker, so a partial write, a crash between the
marker and the rename, or a half-deleted folder is never taken for a checkpoint. This module owns
naming, committing, listing, pruning and cleaning up; it does not write checkpoint contents and
does no cross-rank coordination (the checkpointer decides who calls what, and when).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = "COMMITTED"
_FINAL = re.compile(r"^step_(\d+)$")
_PARTIAL_SUFFIX = ".partial"
_DELETING_SUFFIX = ".deleting"


@dataclass(frozen=True)
class CommittedCheckpoint:
    """One committed checkpoint: its step, folder, and the world size that wrote it."""

    step: int
    path: Path
    world_size: int
    committed_at: float


def final_path(directory: str | os.PathLike, step: int) -> Path:
    """The folder a committed checkpoint of ``step`` lives in."""
    return Path(directory) / f"step_{step:09d}"


def partial_path(directory: str | os.PathLike, step: int, session: str) -> Path:
    """The folder the ranks write ``step`` into before it is committed (unique per session)."""
    return Path(directory) / f"step_{step:09d}.{session}{_PARTIAL_SUFFIX}"


def committed_checkpoints(directory: str | os.PathLike) -> list[CommittedCheckpoint]:
    """Every committed checkpoint in ``directory``, oldest step first; [] when there is none.

    A folder without a readable ``COMMITTED`` marker is skipped (it was never committed).
    """
    root = Path(directory)
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        match = _FINAL.match(entry.name)
        if not match or not entry.is_dir():
            continue
        try:
            marker = json.loads((Path(entry.path) / MARKER).read_text())
        except (OSError, ValueError):
            continue
        found.append(
            CommittedCheckpoint(
                step=int(match.group(1)),
                path=Path(entry.path),
                world_size=int(marker.get("world_size", 0)),
                committed_at=float(marker.get("committed_at", 0.0)),
            )
        )
    return sorted(found, key=lambda c: c.step)


def latest_committed(directory: str | os.PathLike) -> CommittedCheckpoint | None:
    """The committed checkpoint with the highest step in ``directory``, or None.

    Example:
        >>> latest = latest_committed("/ckpt/run-1")
        >>> latest.step if latest else None
    """
    found = committed_checkpoints(directory)
    return found[-1] if found else None


def commit(partial: Path, step: int, world_size: int) -> Path:
    """Marks ``partial`` as complete and renames it to its final name; returns the final path.

    Call only after every rank's write of ``step`` has finished. Raises OSError when the marker
    or the rename cannot be written; ``partial`` is then left as it is (never taken for committed).
    """
    marker = {"step": step, "world_size": world_size, "committed_at": time.time()}
    tmp = partial / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, partial / MARKER)
    _fsync_dir(partial)
    final = final_path(partial.parent, step)
    if final.exists():
        # Re-saving a step (after resuming from an older checkpoint): move the old copy aside first;
        # rename cannot replace a non-empty directory.
        _discard(final)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    return final


def prune(directory: str | os.PathLike, keep: int) -> list[int]:
    """Deletes all but the ``keep`` newest committed checkpoints; returns the deleted steps."""
    found = committed_checkpoints(directory)
    doomed = found[:-keep] if keep > 0 else found
    for ckpt in doomed:
        _discard(ckpt.path)
    return [c.step for c in doomed]


def discard_partial(partial: Path) -> None:
    """Removes a partial checkpoint folder (best effort: a full or read-only disk may refuse)."""
    _discard(partial)


def remove_stale(directory: str | os.PathLike, session: str) -> list[str]:
    """Removes partial folders of other sessions and half-deleted folders; returns their names.

    Run on rank 0 at start-up, before this session writes anything: anything partial then is a
    leftover of a crashed or killed save.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(Path(directory)))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        name = entry.name
        stale_partial = name.endswith(_PARTIAL_SUFFIX) and f".{session}." not in name
        if (stale_partial or name.endswith(_DELETING_SUFFIX)) and entry.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(name)
    return removed


def _discard(path: Path) -> None:
    # Rename first so that a crash half-way through the delete leaves a name nothing reads.
    doomed = path.with_name(f".{path.name}.{os.getpid()}{_DELETING_SUFFIX}")
    try:
        os.rename(path, doomed)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry itself is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
