"""The ETT event format of CONTRACT §4: the schema, the JSON-lines writer and the reader.

This module is the interface file of ``warmstart.metrics``: what a line holds, how it is written (one
``write`` per batch of whole lines, appended, so several writers never clobber each other) and how a
run directory is read back: torn lines (fragments of interrupted writes, see :func:`read_events`) are
skipped with a warning naming the file and line, anywhere in a file; a line that is a complete JSON
value but not a valid event is an :class:`EventFormatError` naming the file and line. It knows nothing
about buckets or reports.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec

from warmstart.errors import WarmstartError

ATTEMPT_START = "attempt_start"
BEGIN = "begin"
END = "end"
STEP = "step"
CHECKPOINT_COMMITTED = "checkpoint_committed"
FAILURE = "failure"
TRAIN_END = "train_end"
ATTEMPT_END = "attempt_end"

EVENT_KINDS = (ATTEMPT_START, BEGIN, END, STEP, CHECKPOINT_COMMITTED, FAILURE, TRAIN_END, ATTEMPT_END)
FAILURE_CATEGORIES = ("infra", "preemption", "user")

# Span names CONTRACT §4 lists; any other name is accepted too (it becomes its own bucket unless the
# event maps it with ``bucket``).
KNOWN_SPANS = ("compile", "sharding_plan", "process_group_init", "data_loader_init", "model_transform",
               "checkpoint_load", "checkpoint_save", "eval")


class EventFormatError(WarmstartError, ValueError):
    """A line of an event file is not a valid CONTRACT §4 event. The message names file and line."""

    def __init__(self, path: str | os.PathLike, line: int, problem: str) -> None:
        self.path, self.line, self.problem = str(path), line, problem
        super().__init__(f"{path}:{line}: {problem}")


class TornLineWarning(UserWarning):
    """A torn line of an event file (a fragment of an interrupted write) was skipped; the message names
    the file and line."""


class Event(msgspec.Struct, frozen=True, gc=False):
    """One validated event line; the optional fields are set only for the kinds that carry them.

    A msgspec struct: a well-formed file is decoded and type-checked in C (a million events in about a
    second); :func:`parse_event` is the reference check, used line by line when that fast path refuses
    a file, and words the error.
    """

    ts: Annotated[float, msgspec.Meta(gt=-1e300, lt=1e300)]  # the bounds refuse inf and nan
    job: str
    attempt: Annotated[int, msgspec.Meta(ge=0)]
    rank: Annotated[int, msgspec.Meta(ge=-1)]
    event: str
    span: str | None = None
    bucket: str | None = None
    step: int | None = None
    samples: Annotated[int, msgspec.Meta(ge=0)] | None = None
    devices: Annotated[int, msgspec.Meta(ge=1)] | None = None
    reason: str | None = None
    category: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The event as the JSON object of its line (optional fields left out when unset)."""
        return {key: value for key in self.__struct_fields__ if (value := getattr(self, key)) is not None}


_DECODER = msgspec.json.Decoder(Event)


def _int(obj: dict, key: str, required: bool, minimum: int | None = None) -> int | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise ValueError(f"missing field {key!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        # 3.0 written by a tool that only has floats is still an integer.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"field {key!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"field {key!r} must be >= {minimum}, got {value}")
    return value


def _str(obj: dict, key: str, required: bool) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise ValueError(f"missing field {key!r}")
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"field {key!r} must be a non-empty string, got {value!r}")
    return value


def parse_event(obj: Any) -> Event:
    """Validate one decoded JSON line and return it as an :class:`Event`.

    Unknown extra fields are allowed (writers may add their own) and ignored.

    Raises:
        ValueError: a required field is missing or a field has the wrong type or value.
    """
    return _parse_checked(obj)


def _parse_checked(obj: Any) -> Event:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError("missing field 'ts'" if ts is None else f"field 'ts' must be a number, got {ts!r}")
    kind = obj.get("event")
    if kind not in EVENT_KINDS:
        raise ValueError(f"field 'event' must be one of {', '.join(EVENT_KINDS)}, got {kind!r}")
    job = obj.get("job")
    if not isinstance(job, str):
        raise ValueError("missing field 'job'" if job is None else f"field 'job' must be a string, got {job!r}")
    attempt = _int(obj, "attempt", True, 0)
    rank = _int(obj, "rank", True, -1)
    fields: dict[str, Any] = {}
    if kind in (BEGIN, END):
        fields["span"] = _str(obj, "span", True)
        fields["bucket"] = _str(obj, "bucket", False)
    elif kind == STEP:
        fields["step"] = _int(obj, "step", True)
        fields["samples"] = _int(obj, "samples", False, 0)
    elif kind == CHECKPOINT_COMMITTED:
        fields["step"] = _int(obj, "step", True)
    elif kind == ATTEMPT_START:
        fields["devices"] = _int(obj, "devices", False, 1)
    elif kind == FAILURE:
        reason = obj.get("reason", "")
        if not isinstance(reason, str):
            raise ValueError(f"field 'reason' must be a string, got {reason!r}")
        category = obj.get("category")
        if category not in FAILURE_CATEGORIES:
            raise ValueError(f"field 'category' must be one of {', '.join(FAILURE_CATEGORIES)}, got {category!r}")
        fields["reason"], fields["category"] = reason, category
    return Event(float(ts), job, attempt, rank, kind, **fields)  # type: ignore[arg-type]


def read_events(path: str | os.PathLike) -> list[Event]:
    """Read one JSON-lines event file.

    Blank lines are ignored. A *torn line* is a non-blank line that is not valid JSON: what an
    interrupted write leaves (a writer killed mid-write, a forked child that died with half a batch
    written, a short write retried after another writer appended). It is skipped, wherever it is in
    the file, with a :class:`TornLineWarning` naming file and line. A fragment that lacked its newline
    is glued to the line written after it: when a torn line ends with a complete JSON object that
    starts at a ``{`` (the next writer's event), that object is kept (validated like any line) and
    only the fragment before it is skipped. Warnings name the first
    :data:`TORN_WARNINGS_PER_FILE` torn lines of a file, then one more counts the rest.

    Raises:
        EventFormatError: a line that is valid JSON is not a valid event (file and line named).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EventFormatError(path, 0, f"cannot read: {exc.strerror}") from None
    torn = _TornLines(path)
    cut = data.rfind(b"\n") + 1
    if data[cut:].strip():  # the last line lacks its newline: complete, or torn?
        try:
            json.loads(data[cut:])
        except ValueError:
            last = data.count(b"\n") + 1
            recovered = _recover_glued(data[cut:])
            if recovered is None:  # the usual torn write: keep the whole file on the fast path
                torn.note(last, "torn last line skipped (the writer died mid-write)")
                data = data[:cut]
            # else the line-by-line reader keeps the event and reports the fragment
    # Fast path: decode and type-check the whole file in C, then the per-kind rules in one pass. Any
    # refusal sends the file through the line-by-line reference check, which names the line.
    try:
        events = _DECODER.decode_lines(data)
    except msgspec.DecodeError:
        events = _read_mixed(path, data.split(b"\n"), torn)
    else:
        if _first_kind_problem(events) is not None or not _one_event_per_line(data, len(events)):
            events = _read_mixed(path, data.split(b"\n"), torn)
    torn.flush()
    return events


#: How many torn lines of one file get a warning each; the rest are counted in one more.
TORN_WARNINGS_PER_FILE = 5


class _TornLines:
    """Collects a file's torn lines and warns about them (file and line named), a bounded number."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[int, str]] = []

    def note(self, line: int, what: str) -> None:
        self.lines.append((line, what))

    def flush(self) -> None:
        self.lines.sort()
        for line, what in self.lines[:TORN_WARNINGS_PER_FILE]:
            warnings.warn(f"{self.path}:{line}: {what}", TornLineWarning, stacklevel=3)
        rest = self.lines[TORN_WARNINGS_PER_FILE:]
        if rest:
            shown = ", ".join(str(line) for line, _ in rest[:20]) + (", ..." if len(rest) > 20 else "")
            warnings.warn(f"{self.path}:{rest[0][0]}: {len(rest)} more torn lines skipped (lines {shown})",
                          TornLineWarning, stacklevel=3)
        self.lines = []


def _recover_glued(raw: bytes) -> Any | None:
    """The complete JSON object that ends a torn line (a fragment without its newline, then the next
    write's line), or ``None``. The leftmost ``{`` after the start from which the rest parses wins;
    at most :data:`_GLUE_TRIES` are tried, so a long line of garbage costs little."""
    start = raw.find(b"{", 1)
    for _ in range(_GLUE_TRIES):
        if start == -1:
            break
        try:
            obj = json.loads(raw[start:])
        except ValueError:
            start = raw.find(b"{", start + 1)
            continue
        return obj if isinstance(obj, dict) else None
    return None


_GLUE_TRIES = 64


def _one_event_per_line(data: bytes, n_events: int) -> bool:
    lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    if lines == n_events:
        return True
    return sum(1 for raw in data.split(b"\n") if raw.strip()) == n_events  # blank lines do not count


def _first_kind_problem(events: list[Event]) -> int | None:
    """Index of the first event that breaks a per-kind rule the struct types cannot express."""
    for i, ev in enumerate(events):
        kind = ev.event
        if kind == STEP or kind == CHECKPOINT_COMMITTED:
            if ev.step is None:
                return i
        elif kind == BEGIN or kind == END:
            if not ev.span or ev.bucket == "":
                return i
        elif kind == FAILURE:
            if ev.category not in FAILURE_CATEGORIES or ev.reason is None:
                return i
        elif kind not in EVENT_KINDS:
            return i
    return None


def _read_lines(path: Path, lines: list[bytes], torn: _TornLines | None = None) -> list[Event]:
    """The line-by-line reference reader: torn lines are noted in ``torn`` (warned about at once when
    none is given), any other bad line raises :class:`EventFormatError`."""
    notes = _TornLines(path) if torn is None else torn
    events: list[Event] = []
    last = len(lines) - 1
    for index, raw in enumerate(lines):
        if raw.strip():
            event = _parse_line(path, index + 1, raw, notes, index == last)
            if event is not None:
                events.append(event)
    if torn is None:
        notes.flush()
    return events


def _read_mixed(path: Path, lines: list[bytes], torn: _TornLines) -> list[Event]:
    """:func:`_read_lines`, with each line first tried in C as the whole-file fast path does; a line
    refused there goes through the reference check. A file with a torn line reads at near fast-path
    speed instead of the reference's (1M events, one torn line: 2 s, not 13 s; 1 s without it)."""
    events: list[Event] = []
    decode = _DECODER.decode
    last = len(lines) - 1
    for index, raw in enumerate(lines):
        try:
            event = decode(raw)
        except msgspec.DecodeError:
            pass
        else:
            if _first_kind_problem((event,)) is None:
                events.append(event)
                continue
        if raw.strip():
            event = _parse_line(path, index + 1, raw, torn, index == last)
            if event is not None:
                events.append(event)
    return events


def _parse_line(path: Path, line: int, raw: bytes, torn: _TornLines, last: bool) -> Event | None:
    """One non-blank line: its event, or ``None`` for a torn line (noted in ``torn``).

    Raises:
        EventFormatError: the line is valid JSON but not a valid event.
    """
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = _recover_glued(raw)
        if obj is not None:
            try:
                event = parse_event(obj)
            except ValueError:  # the split guessed wrong: the whole line is a fragment
                pass
            else:
                torn.note(line, "torn fragment skipped before the event on this line (a write cut short before "
                                "its newline); the event was kept")
                return event
        torn.note(line, "torn last line skipped (the writer died mid-write)" if last else
                  "torn line skipped (a fragment of an interrupted write)")
        return None
    try:
        return parse_event(obj)
    except ValueError as exc:
        raise EventFormatError(path, line, str(exc)) from None


def event_files(run_dir: str | os.PathLike) -> list[Path]:
    """The ``*.jsonl`` files of a run directory (searched recursively), sorted by path.

    Raises:
        EventFormatError: ``run_dir`` is not a directory.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EventFormatError(run_dir, 0, "not a run directory (expected a directory of *.jsonl event files)")
    return sorted(run_dir.rglob("*.jsonl"))


def encode_events(events: Iterable[Event | dict[str, Any]]) -> bytes:
    """Encode events as JSON lines, each ending with a newline."""
    parts = []
    for ev in events:
        obj = ev.to_dict() if isinstance(ev, Event) else ev
        parts.append(json.dumps(obj, separators=(",", ":")))
    return ("\n".join(parts) + "\n").encode() if parts else b""


class EventWriter:
    """Appends whole lines to one event file with a single ``write`` per batch.

    The file is opened ``O_APPEND`` and only when the first batch arrives, so a process that records
    nothing leaves no empty file, and several processes writing the same file never overwrite each
    other's lines.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def write(self, data: bytes) -> None:
        """Append ``data`` (whole lines) to the file, creating it and its directory on first use."""
        if not data:
            return
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        view = memoryview(data)
        while view:  # a regular file takes it all at once; loop for the rare short write
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self) -> None:
        """Close the file; a later :meth:`write` reopens it."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_events(path: str | os.PathLike, events: Sequence[Event | dict[str, Any]]) -> None:
    """Append ``events`` to the JSON-lines file ``path`` (for schedulers, tools and tests)."""
    writer = EventWriter(path)
    try:
        writer.write(encode_events(events))
    finally:
        writer.close()
