"""Event files on disk: the recorder's file name, a run directory's files and a tailer of growing files.

The recorder writes one file per rank and attempt, ``events-r{rank}-a{attempt}.jsonl``, directly in
the run directory; readers take every ``*.jsonl`` file under it, whoever wrote it. This module owns
that name (:func:`file_name`, :func:`rank_attempt`), the listings (:func:`event_files`,
:func:`recorder_files`) and :class:`LineTail`, which follows a file while a job appends to it. It
reads bytes and knows nothing about what a line holds: that is ``events``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from warmstart.metrics.events import EventFormatError

_RECORDER_FILE = re.compile(r"events-r(-?\d+)-a(\d+)\.jsonl")


def file_name(rank: int, attempt: int) -> str:
    """The name of the recorder's file of ``rank`` and ``attempt``."""
    return f"events-r{rank}-a{attempt}.jsonl"


def rank_attempt(path: str | os.PathLike) -> tuple[int, int] | None:
    """The rank and attempt of a recorder's file, from its name; ``None`` for any other file."""
    match = _RECORDER_FILE.fullmatch(Path(path).name)
    return (int(match[1]), int(match[2])) if match else None


def event_files(run_dir: str | os.PathLike) -> list[Path]:
    """The ``*.jsonl`` files of a run directory (searched recursively), sorted by path.

    Raises:
        EventFormatError: ``run_dir`` is not a directory.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EventFormatError(run_dir, None, "not a run directory (expected a directory of *.jsonl event files)")
    return sorted(run_dir.rglob("*.jsonl"))


def recorder_files(run_dir: str | os.PathLike, *, rank: int | None = None) -> list[Path]:
    """The recorder's files directly in ``run_dir`` (only ``rank``'s, if given), by rank then attempt;
    none while ``run_dir`` does not exist."""
    found = []
    for path in Path(run_dir).glob("events-r*-a*.jsonl"):
        key = rank_attempt(path)
        if key is not None and (rank is None or key[0] == rank):
            found.append((key, path))
    return [path for _, path in sorted(found)]


class LineTail:
    """Follows one growing file: each :meth:`read` returns the complete lines appended since the last
    one; a torn last line (a write under way) waits for the next read."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._offset = 0

    def read(self) -> tuple[bytes, bool]:
        """The complete lines appended since the last read, and whether the file was read afresh: it
        shrank (replaced or truncated), so the lines read before are gone from it.

        Raises:
            OSError: the file cannot be read; the next read starts where this one would have.
        """
        offset = self._offset
        with open(self.path, "rb") as f:
            afresh = os.fstat(f.fileno()).st_size < offset
            if afresh:
                offset = 0
            f.seek(offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self._offset = offset + cut
        return data[:cut], afresh
