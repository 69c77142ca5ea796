"""What a preloader's imports read from the process they run in, recorded while they run.

A forked child inherits everything its preloader's imports computed; a new interpreter would compute
it from its own process. So what those imports read is recorded as they read it, rather than listed
by hand: the environment variables they ask for by name, the files they open, the top-level names
they looked for and did not find, and the random generators they seeded from the OS's entropy. The
preloader then watches the files (a changed data file stales it), and each child compares the rest
with its program's own process before it runs the program (see :mod:`warmstart.preload.child`).

The working directory is found by value instead: the imports run in an empty directory of a name
nothing else has, and every string that holds that name afterwards was made from it
(:func:`working_directory_strings`); each child puts its program's directory in its place.

Whole-environment scans (``os.environ.items()``, ``os.environ.copy()``) are recorded by the module
that made them, not by name: what such a scan depends on is up to its caller (``tqdm`` reads
``TQDM_*``). Prefixes in :mod:`warmstart.preload.environment` cover the ones torch's imports make.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import random
import sys
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

#: Modules whose frames are the machinery between a caller and ``os.environ``.
_MAPPING_MODULES = ("os", "collections.abc")
#: Functions of those modules that read every variable: a scan, not a read by name.
_SCANS = ("__iter__", "copy", "__repr__", "__eq__", "items", "values", "keys", "__len__")


@dataclass
class ImportReads:
    """What the imports read (see the module's docstring)."""

    #: variable name -> its value when first read (``None``: unset)
    environ: dict[str, str | None] = field(default_factory=dict)
    #: modules that scanned the whole environment
    environ_scans: set[str] = field(default_factory=set)
    #: absolute paths of the files opened (not directories)
    files: set[str] = field(default_factory=set)
    #: the working directory while they ran
    cwd: str = ""
    #: top-level module names looked for on ``sys.path`` and not found (optional imports)
    missing: set[str] = field(default_factory=set)
    #: random generators seeded from the OS's entropy (as a new interpreter seeds them anew)
    entropy_seeded: list[weakref.ref] = field(default_factory=list)


class _RecordingEnviron(type(os.environ)):  # type: ignore[misc]  # os._Environ, which typeshed hides
    """``os.environ`` itself (the same variables, the same ``putenv``), noting reads by name."""

    reads: ImportReads | None = None

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def _note(self, key) -> None:
        reads = self.reads
        if reads is None or not isinstance(key, str):
            return
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__") in _MAPPING_MODULES:
            if frame.f_code.co_name in _SCANS:
                reads.environ_scans.add(_caller_module(frame.f_back))
                return
            frame = frame.f_back
        if key not in reads.environ:
            value = self._data.get(self.encodekey(key))
            reads.environ[key] = None if value is None else self.decodevalue(value)


def _caller_module(frame) -> str:
    while frame is not None and frame.f_globals.get("__name__") in _MAPPING_MODULES:
        frame = frame.f_back
    return str(frame.f_globals.get("__name__")) if frame is not None else "?"


class _MissingFinder:
    """Last on ``sys.meta_path``: asked only for what no finder found."""

    def __init__(self, reads: ImportReads) -> None:
        self.reads = reads

    def find_spec(self, name, path=None, target=None):
        if path is None and "." not in name:
            self.reads.missing.add(name)
        return None


@contextlib.contextmanager
def recording() -> Iterator[ImportReads]:
    """Record what the code run inside reads (see :class:`ImportReads`); everything patched is put
    back when it ends, also when it raises."""
    reads = ImportReads(cwd=os.getcwd())
    original = os.environ
    recorder = _RecordingEnviron(
        original._data,  # type: ignore[attr-defined]
        original.encodekey,
        original.decodekey,
        original.encodevalue,
        original.decodevalue,
    )
    recorder.reads = reads
    open_, os_open, seed = builtins.open, os.open, random.Random.seed
    finder = _MissingFinder(reads)

    def recorded_open(file, *args, **kwargs):
        _note_file(reads, file)
        return open_(file, *args, **kwargs)

    def recorded_os_open(path, *args, **kwargs):
        _note_file(reads, path)
        return os_open(path, *args, **kwargs)

    def recorded_seed(self, a=None, version=2):
        if a is None:
            reads.entropy_seeded.append(weakref.ref(self))
        else:  # seeded on purpose afterwards: a new interpreter would do the same
            reads.entropy_seeded[:] = [r for r in reads.entropy_seeded if r() is not self]
        return seed(self, a, version)

    os.environ = recorder  # noqa: B003  # the same variables: replaced, not cleared
    builtins.open = io.open = recorded_open
    os.open = recorded_os_open
    random.Random.seed = recorded_seed  # type: ignore[method-assign]
    sys.meta_path.append(finder)
    try:
        yield reads
    finally:
        recorder.reads = None  # modules that kept it (``from os import environ``) read on, unrecorded
        os.environ = original  # noqa: B003
        builtins.open = io.open = open_
        os.open = os_open
        random.Random.seed = seed  # type: ignore[method-assign]
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)


#: Files the kernel makes up as they are read: no import's data.
_KERNEL_FILES = ("/proc/", "/sys/", "/dev/")


def _note_file(reads: ImportReads, file) -> None:
    if isinstance(file, (str, bytes, os.PathLike)):
        with contextlib.suppress(Exception):
            path = os.path.join(reads.cwd, os.fsdecode(file))  # not abspath: it asks os.getcwd
            if os.path.isfile(path) and not path.startswith(_KERNEL_FILES):
                reads.files.add(path)


@dataclass
class Strings:
    """Where strings holding a marker are (see :func:`working_directory_strings`)."""

    #: (mapping or list, key or index) of each one that can be replaced in place
    places: list[tuple[object, object]] = field(default_factory=list)
    #: what holds one that cannot (a tuple, a set, a key), described
    fixed: list[str] = field(default_factory=list)


def working_directory_strings(directory: str) -> Strings:
    """Every string that the objects alive now refer to and that contains ``directory``: values made
    from the working directory while it was ``directory``. Those in a dict, a list, an object's or a
    class's attributes can be replaced (``places``); any other holder is described (``fixed``). Walks
    every object the garbage collector tracks, once."""
    import gc

    found = Strings()
    for obj in gc.get_objects():
        if not _holds(gc.get_referents(obj), directory):
            continue
        kind = type(obj)
        if kind is dict:
            items = list(obj.items())
        elif kind is list:
            items = list(enumerate(obj))
        elif isinstance(obj, type) or isinstance(getattr(obj, "__dict__", None), dict):
            holder = obj if isinstance(obj, type) else obj.__dict__
            for key, value in vars(obj).items():
                if type(value) is str and directory in value:
                    found.places.append((holder, key))
            continue
        elif kind is types.CellType:
            found.places.append((obj, "cell_contents"))
            continue
        else:
            found.fixed.append(f"a {kind.__name__}")
            continue
        for key, value in items:
            if type(value) is str and directory in value:
                found.places.append((obj, key))
            if type(key) is str and directory in key:
                found.fixed.append(f"a key of a {kind.__name__}: {key!r}")
    return found


def _holds(values: list, directory: str) -> bool:
    # A loop, not a generator expression: its closure would be one more holder of the directory.
    return any(type(value) is str and directory in value for value in values)


def replace_strings(found: Strings, old: str, new: str) -> None:
    """Put ``new`` in place of ``old`` in the strings at ``found.places``."""
    for holder, key in found.places:
        with contextlib.suppress(Exception):
            if isinstance(holder, (type, types.CellType)):
                setattr(holder, str(key), getattr(holder, str(key)).replace(old, new))
            else:
                holder[key] = holder[key].replace(old, new)  # type: ignore[index]
