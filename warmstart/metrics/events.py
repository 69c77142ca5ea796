"""The ETT event format (docs/reference.md#events): the schema, the JSON-lines writer and the reader.

This module is the interface file of ``warmstart.metrics``. The schema is one msgspec struct per
event kind, a union tagged by the ``event`` field: the same types encode what the recorder and
:func:`write_events` write, decode a run directory (a whole file at once, in C) and word what is
wrong with a bad line. Lines are appended with one ``write`` per batch, so several writers never
clobber each other. Torn lines (fragments of interrupted writes, see :func:`read_events`) are
skipped with a warning naming file and line, anywhere in a file; any other line that is not a valid
event (text that is no piece of an event line, a complete JSON value that breaks the schema) is an
:class:`EventFormatError` naming file and line. It knows nothing about buckets or reports.
"""

from __future__ import annotations

import json
import operator
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec

from warmstart.errors import WarmstartError

_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
_Count = Annotated[int, msgspec.Meta(ge=0)]
FailureCategory = Literal["infra", "preemption", "user"]
FAILURE_CATEGORIES: tuple[str, ...] = get_args(FailureCategory)


class _Event(msgspec.Struct, frozen=True, gc=False, tag_field="event", omit_defaults=True):
    """The fields of every line; ``event``, the tag, is the kind's name (a class attribute)."""

    ts: Annotated[float, msgspec.Meta(gt=-1e300, lt=1e300)]  # the bounds refuse inf and nan
    job: str
    attempt: _Count
    rank: Annotated[int, msgspec.Meta(ge=-1)]

    event: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """The event as the JSON object of its line (unset optional fields left out)."""
        return msgspec.to_builtins(self)


class AttemptStart(_Event, tag="attempt_start", frozen=True):
    """Hardware is allocated to this attempt: its clock starts."""

    devices: Annotated[int, msgspec.Meta(ge=1)] | None = None


class _SpanEvent(_Event, frozen=True):
    span: _NonEmpty
    bucket: _NonEmpty | None = None


class Begin(_SpanEvent, tag="begin", frozen=True):
    """A named interval starts; ``bucket`` maps a custom span to a known bucket."""


class End(_SpanEvent, tag="end", frozen=True):
    """The most recent open ``begin`` of the same span on the same rank ends."""


class Step(_Event, tag="step", frozen=True):
    """Step ``step`` starts consuming a batch (of ``samples`` samples)."""

    step: int
    samples: _Count | None = None


class CheckpointCommitted(_Event, tag="checkpoint_committed", frozen=True):
    """The checkpoint holding every step ``<= step`` is durable."""

    step: int


ResumeSource = Literal["checkpoint", "keeper", "buddy"]
RESUME_SOURCES: tuple[str, ...] = get_args(ResumeSource)


class Resume(_Event, tag="resume", frozen=True):
    """The attempt goes on after step ``step``, restored from ``source``: a ``checkpoint``, this
    node's snapshot ``keeper`` or another node's (``buddy``); every step ``<= step`` is kept."""

    step: int
    source: ResumeSource


class Failure(_Event, tag="failure", omit_defaults=False, frozen=True):  # a failure always writes its reason
    """The attempt dies here."""

    category: FailureCategory
    reason: str = ""


class TrainEnd(_Event, tag="train_end", frozen=True):
    """The training loop finished: shutdown starts."""


class AttemptEnd(_Event, tag="attempt_end", frozen=True):
    """The attempt released its hardware."""


Event = AttemptStart | Begin | End | Step | CheckpointCommitted | Failure | TrainEnd | AttemptEnd | Resume
"""One line of an event file, as the struct of its kind."""

_KINDS: tuple[type[_Event], ...] = get_args(Event)
for _kind in _KINDS:
    _kind.event = str(_kind.__struct_config__.tag)  # every kind is tagged with its name
del _kind
EVENT_KINDS: tuple[str, ...] = tuple(kind.event for kind in _KINDS)

_DECODER = msgspec.json.Decoder(Event)


# numpy's and torch's integers are not ints: msgspec asks operator.index how to write them.
_ENCODER = msgspec.json.Encoder(enc_hook=operator.index)


class EventFormatError(WarmstartError, ValueError):
    """A line of an event file is not a valid event, or a path holds no event files. The message names
    the file and line (``line`` is ``None`` when the problem is the path itself)."""

    def __init__(self, path: str | os.PathLike, line: int | None, problem: str) -> None:
        self.path, self.line, self.problem = str(path), line, problem
        super().__init__(f"{path}: {problem}" if line is None else f"{path}:{line}: {problem}")


class TornLineWarning(UserWarning):
    """A torn line of an event file (a fragment of an interrupted write) was skipped; the message names
    the file and line."""


def parse_event(obj: Any) -> Event:
    """Validate one decoded JSON line and return its event.

    Unknown extra fields are allowed (writers may add their own) and ignored. An integer may be
    written as a float without a fraction (``3.0``), as tools that only have floats do.

    Raises:
        ValueError: a required field is missing or a field has the wrong type or value.
    """
    while True:  # each retry turns one more float into an int: a few at most
        try:
            return msgspec.convert(obj, Event)
        except msgspec.ValidationError as exc:
            fixed = _integral_float_fixed(obj, str(exc))
            if fixed is None:
                raise ValueError(_problem(str(exc), obj)) from None
            obj = fixed


def _integral_float_fixed(obj: Any, message: str) -> dict[str, Any] | None:
    """``obj`` with the integral float msgspec refused as an ``int`` turned into one, or ``None``."""
    match = re.fullmatch(r"Expected `int`, got `float` - at `\$\.(\w+)`", message)
    value = obj.get(match[1]) if match else None
    if isinstance(value, float) and value.is_integer():
        return {**obj, match[1]: int(value)}  # type: ignore[index]
    return None


_EXPECTED = {"int": "an integer", "float": "a number", "str": "a string"}


def _problem(message: str, obj: Any) -> str:
    """msgspec's validation error reworded for people: the field named in quotes, its value shown."""
    what, _, where = message.partition(" - at `$")
    field = where.rstrip("`").rpartition(".")[2] or None
    missing = re.fullmatch(r"Object missing required field `(\w+)`", what)
    if missing:
        return f"missing field {missing[1]!r}"
    if field is None or not isinstance(obj, dict):
        if what.startswith("Expected `object`"):
            return f"expected a JSON object, got {type(obj).__name__}"
        return what.replace("`", "")
    if field == "event":
        need = "one of " + ", ".join(EVENT_KINDS)
    elif what.startswith("Invalid enum value"):
        need = "one of " + ", ".join(FAILURE_CATEGORIES)
    elif (bound := re.fullmatch(r"Expected `int` >= (-?\d+)", what)) is not None:
        need = f">= {bound[1]}"
    elif what.startswith("Expected `float` "):  # out of the bounds: inf, nan or absurd
        need = "a finite number"
    elif what.startswith("Expected `str` of length"):
        need = "a non-empty string"
    elif (kind := re.match(r"Expected `(\w+)(?: \| null)?`", what)) is not None and kind[1] in _EXPECTED:
        need = _EXPECTED[kind[1]]
    else:
        return f"field {field!r}: {what.replace('`', '')}"
    return f"field {field!r} must be {need}, got {obj.get(field)!r}"


def read_events(path: str | os.PathLike) -> list[Event]:
    """Read one JSON-lines event file.

    Blank lines are ignored. A *torn line* is what an interrupted write leaves (a writer killed
    mid-write, a forked child that died with half a batch written, a short write retried after another
    writer appended): a line that is not valid JSON but is a piece of a JSON object's line, either its
    start (``{`` and valid JSON as far as it goes, see :func:`is_fragment`) or its end (the rest of an
    object, ending with ``}``). It is skipped, wherever it is in the file, with a
    :class:`TornLineWarning` naming file and line. A fragment that lacked its newline is glued to the
    line written after it: when a torn line ends with a complete JSON object that starts at a ``{``
    (the next writer's event), that object is kept (validated like any line) and only the fragment
    before it is skipped. Warnings name the first :data:`TORN_WARNINGS_PER_FILE` torn lines of a
    file, then one more counts the rest.

    Raises:
        EventFormatError: a line is neither a valid event nor a torn line (text that is no piece of
            an event line, a complete JSON value that breaks the schema); file and line named.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EventFormatError(path, None, f"cannot read: {exc.strerror}") from None
    torn = _TornLines(path)
    cut = data.rfind(b"\n") + 1
    if data[cut:].strip():  # the last line lacks its newline: complete, or torn?
        try:
            json.loads(data[cut:])
        except ValueError:
            # The usual torn write: keep the file on the fast path. Anything else (a glued event, text
            # that is no fragment) goes to the line-by-line reader, which keeps the event or names the line.
            if _recover_glued(data[cut:]) is None and is_fragment(data[cut:]):
                torn.note(data.count(b"\n") + 1, "torn last line skipped (the writer died mid-write)")
                data = data[:cut]
            # else the line-by-line reader keeps the event and reports the fragment
    # Fast path: decode and validate the whole file in C. Any refusal (a torn line, an integer
    # written as 3.0, a bad line) sends the file through the line-by-line reader, which names the line.
    try:
        events = _DECODER.decode_lines(data)
    except msgspec.DecodeError:
        events = _read_lines(path, data.split(b"\n"), torn)
    else:
        if not _one_event_per_line(data, len(events)):  # two JSON values on one line: a glued fragment
            events = _read_lines(path, data.split(b"\n"), torn)
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
            warnings.warn(
                f"{self.path}:{rest[0][0]}: {len(rest)} more torn lines skipped (lines {shown})",
                TornLineWarning,
                stacklevel=3,
            )
        self.lines = []


def _recover_glued(raw: bytes) -> tuple[int, dict[str, Any]] | None:
    """Where the complete JSON object that ends a torn line starts (a fragment without its newline,
    then the next write's line), and the object; or ``None``. The leftmost ``{`` after the start from
    which the rest parses wins, and the text before it must be a fragment (:func:`is_fragment`); at
    most :data:`_GLUE_TRIES` are tried, so a long line of garbage costs little."""
    start = raw.find(b"{", 1)
    for _ in range(_GLUE_TRIES):
        if start == -1:
            break
        try:
            obj = json.loads(raw[start:])
        except ValueError:
            start = raw.find(b"{", start + 1)
            continue
        return (start, obj) if isinstance(obj, dict) and is_fragment(raw[:start]) else None
    return None


_GLUE_TRIES = 64

# What may follow the point where a JSON prefix stops: the start of a number or of true/false/null.
_PARTIAL_TOKEN = re.compile(r"[-+.eE0-9]*|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?")
# What may stand before the end of an object to make it whole: the end starts at a key, inside a key,
# at its colon, at a value, inside a string value, or at the comma after a value.
_TAIL_HEADS = ("{", '{"', '{"_"', '{"_":', '{"_":"', '{"_":0')


def is_fragment(raw: bytes | str) -> bool:
    """Whether a line that is not valid JSON is a piece of an interrupted write of a JSON object line:
    its start (a ``{`` and valid JSON as far as it goes, maybe with another write's start glued after
    it) or its end (the rest of an object: with ``{`` or a key put before it, it parses). Text that is
    neither, ``hello world`` say, is not."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = text.strip()
    if text.startswith("{"):
        cuts = [i for i, c in enumerate(text) if c == "{" and i][:_GLUE_TRIES] + [len(text)]
        if any(_is_json_prefix(text[:cut]) for cut in cuts):
            return True
    if text.endswith("}"):
        for head in _TAIL_HEADS:
            try:
                whole = json.loads(head + text)
            except ValueError:
                continue
            if isinstance(whole, dict):
                return True
    return False


def _is_json_prefix(text: str) -> bool:
    """Whether ``text`` is valid JSON cut short: the parser stops at its end, inside a string that runs
    to the end, or before the unfinished number or literal that ends it."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text) or exc.msg.startswith("Unterminated string"):
            return True
        return _PARTIAL_TOKEN.fullmatch(text[exc.pos :]) is not None
    return False  # complete: not a fragment


def _one_event_per_line(data: bytes, n_events: int) -> bool:
    lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    if lines == n_events:
        return True
    return sum(1 for raw in data.split(b"\n") if raw.strip()) == n_events  # blank lines do not count


def _read_lines(path: Path, lines: list[bytes], torn: _TornLines) -> list[Event]:
    """The line-by-line reader: each line is decoded in C first (a file with one torn line reads at
    near fast-path speed); a line refused there is parsed as JSON and checked by :func:`parse_event`,
    which accepts integers written as floats and words the error. Torn lines are noted in ``torn``."""
    events: list[Event] = []
    decode = _DECODER.decode
    last = len(lines) - 1
    for index, raw in enumerate(lines):
        try:
            events.append(decode(raw))
            continue
        except msgspec.DecodeError:
            pass
        if raw.strip():
            event = _parse_line(path, index + 1, raw, torn, index == last)
            if event is not None:
                events.append(event)
    return events


def _parse_line(path: Path, line: int, raw: bytes, torn: _TornLines, last: bool) -> Event | None:
    """One non-blank line: its event, or ``None`` for a torn line (noted in ``torn``).

    Raises:
        EventFormatError: the line is valid JSON but not a valid event, or not JSON and no fragment.
    """
    try:
        obj = json.loads(raw)
    except ValueError:
        glued = _recover_glued(raw)
        if glued is not None:
            try:
                event = parse_event(glued[1])
            except ValueError:  # the split guessed wrong: the whole line is a fragment
                pass
            else:
                torn.note(
                    line,
                    "torn fragment skipped before the event on this line (a write cut short before "
                    "its newline); the event was kept",
                )
                return event
        if not is_fragment(raw):
            shown = raw.decode("utf-8", "replace").strip()
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise EventFormatError(
                path,
                line,
                f"not an event: {shown!r} is not JSON and no fragment of an "
                "interrupted write (expected one JSON object per line)",
            ) from None
        torn.note(
            line,
            "torn last line skipped (the writer died mid-write)"
            if last
            else "torn line skipped (a fragment of an interrupted write)",
        )
        return None
    try:
        return parse_event(obj)
    except ValueError as exc:
        raise EventFormatError(path, line, str(exc)) from None


def encode_events(events: Iterable[Event | Mapping[str, Any]]) -> bytes:
    """Encode events (structs, or mappings of a line's fields) as JSON lines, each ending with a
    newline, and check them against the schema: what this writes, :func:`read_events` reads.

    Raises:
        ValueError: an event is not valid (the message names it by its index and says why).
        TypeError: a field holds a value JSON cannot hold.
    """
    data = _ENCODER.encode_lines(events)
    try:
        _DECODER.decode_lines(data)
    except msgspec.ValidationError:
        for index, raw in enumerate(data.splitlines()):  # find and word the first bad one
            try:
                parse_event(json.loads(raw))
            except ValueError as exc:
                raise ValueError(f"event {index}: {exc}") from None
    return data


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


def write_events(path: str | os.PathLike, events: Sequence[Event | Mapping[str, Any]]) -> None:
    """Append ``events`` to the JSON-lines file ``path`` (for schedulers, tools and tests).

    Raises:
        ValueError: an event is not valid; nothing is written then.
    """
    data = encode_events(events)
    writer = EventWriter(path)
    try:
        writer.write(data)
    finally:
        writer.close()
