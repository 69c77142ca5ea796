"""Whether anything a preloader imported has changed since: kernel change notifications (inotify)
where the kernel sees every change, a check of the files' stamps where it cannot.

On a local filesystem every write, rename, new file or deletion in a watched directory is queued
by the kernel before the call that made it returns, so a change made before a process was launched
is known when its request comes, at the cost of reading the queue. A network filesystem (NFS,
Lustre, GPFS, CIFS, FUSE...) tells this machine nothing of a change made on another one: those
files are polled, as a preloader always did.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.machinery
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("warmstart.preload")

#: A file's (mtime in ns, size), or (-1, errno) when it cannot be read.
Stamp = tuple[int, int]

#: Filesystems on which the kernel sees every change to a file, so that inotify reports it.
LOCAL_FILESYSTEMS = frozenset(
    {
        "bcachefs",
        "btrfs",
        "erofs",
        "exfat",
        "ext2",
        "ext3",
        "ext4",
        "f2fs",
        "hfsplus",
        "jfs",
        "ntfs3",
        "overlay",
        "ramfs",
        "reiserfs",
        "squashfs",
        "tmpfs",
        "vfat",
        "xfs",
        "zfs",
    }
)

_IMPORT_SUFFIXES = frozenset(importlib.machinery.all_suffixes())
_INSTALL_RECORDS = (".dist-info", ".egg-info", ".egg-link", ".egg", ".pth")


def stamp(path: str) -> Stamp:
    """``path``'s modification time and size (a directory's time changes with its entries)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return (-1, exc.errno or errno.ENOENT)
    return (st.st_mtime_ns, st.st_size)


def importable_entries(directory: str) -> frozenset[str]:
    """What in a ``sys.path`` directory can change what a new interpreter imports or finds
    installed: modules and extension modules (``name.py``, ``name.cpython-311-x86_64-linux-gnu.so``),
    packages (a directory named as a module, with or without ``__init__.py``: an optional import
    that failed here would find one), and install records (``.dist-info``, ``.pth``...). A job's
    log files, hidden folders and directories whose names are no module's (``warmstart-runs``) in
    its project root (an editable install puts that on ``sys.path``) are none of these, so they
    leave the preloader in service; a folder named as a module (``checkpoints``) is one."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        return frozenset({f"<{exc.strerror}>"})
    found = set()
    for name in names:
        stem, dot, _ = name.partition(".")
        if name.endswith(_INSTALL_RECORDS):
            found.add(name)
        elif not dot:
            # __pycache__ appears when a module there is first imported; it holds bytecode of sources
            # already watched, and is no package of its own
            if name != "__pycache__" and name.isidentifier() and os.path.isdir(os.path.join(directory, name)):
                found.add(name)
        elif stem.isidentifier() and name[len(stem) :] in _IMPORT_SUFFIXES:
            found.add(name)
    return frozenset(found)


def filesystem_types() -> dict[str, str]:
    """Mount point -> filesystem type, from ``/proc/self/mountinfo`` (empty where it cannot be read)."""
    mounts = {}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields:
                    continue
                dash = fields.index("-")
                if dash < 5 or dash + 1 >= len(fields):
                    continue
                point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                mounts[point] = fields[dash + 1]  # a later mount on the same point hides an earlier one
    except OSError:
        pass
    return mounts


def filesystem_of(path: str, mounts: dict[str, str]) -> str | None:
    """The type of the filesystem ``path`` (resolved) lies on: its longest mount point."""
    path = os.path.realpath(path)
    while True:
        if path in mounts:
            return mounts[path]
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


@dataclass
class _Directory:
    """What one watched directory holds that the preloader depends on."""

    path: str
    #: its entries whose stamps were taken (modules' files, directories torch's hash walked)
    files: dict[str, list[str]] = field(default_factory=dict)  # name -> the paths stamped for it
    #: paths stamped that are this directory itself (its mtime changes with its entries)
    itself: list[str] = field(default_factory=list)
    #: the ``sys.path`` entries that are this directory (what can be imported from it)
    importable: list[str] = field(default_factory=list)

    def stamped(self) -> list[str]:
        """Every path stamped for this directory: its entries', and its own."""
        return [path for paths in self.files.values() for path in paths] + self.itself


def _merged(one: _Directory, other: _Directory) -> _Directory:
    return _Directory(
        one.path,
        {name: one.files.get(name, []) + other.files.get(name, []) for name in {*one.files, *other.files}},
        one.itself + other.itself,
        one.importable + other.importable,
    )


# inotify's event bits (linux/inotify.h)
_MODIFY, _ATTRIB, _CLOSE_WRITE = 0x2, 0x4, 0x8
_MOVED_FROM, _MOVED_TO, _CREATE, _DELETE = 0x40, 0x80, 0x100, 0x200
_DELETE_SELF, _MOVE_SELF, _UNMOUNT, _Q_OVERFLOW, _IGNORED = 0x400, 0x800, 0x2000, 0x4000, 0x8000
_ONLYDIR = 0x01000000
_ENTRIES = _MOVED_FROM | _MOVED_TO | _CREATE | _DELETE
_GONE = _DELETE_SELF | _MOVE_SELF | _UNMOUNT | _IGNORED
_MASK = _MODIFY | _ATTRIB | _CLOSE_WRITE | _ENTRIES | _DELETE_SELF | _MOVE_SELF | _ONLYDIR


class ImportedFiles:
    """The files and ``sys.path`` directories a preloader's imports came from, and whether any of
    them changed: :meth:`changed` is cheap where the kernel reports changes, and polls the rest.

    ``files`` maps each path to its :func:`stamp` when imported, ``importable`` each ``sys.path``
    directory to its :func:`importable_entries`. ``is_local(directory)`` says whether inotify sees
    every change there (default: the directory's filesystem is in :data:`LOCAL_FILESYSTEMS`).
    """

    def __init__(
        self,
        files: dict[str, Stamp],
        importable: dict[str, frozenset[str]],
        *,
        is_local: Callable[[str], bool] | None = None,
    ) -> None:
        self._stamps = dict(files)
        self._entries = dict(importable)
        self._changed: str | None = None
        self._polled_files: list[str] = []
        self._polled_dirs: list[str] = []
        self._polled_at = float("-inf")
        self._watched: dict[int, _Directory] = {}
        self._full_check = False
        self.full_checks = 0
        self._inotify = None
        directories = self._directories()
        if is_local is None:
            mounts = filesystem_types()

            def is_local(directory: str) -> bool:
                return filesystem_of(directory, mounts) in LOCAL_FILESYSTEMS

        try:
            from inotify_simple import INotify

            self._inotify = INotify(nonblocking=True)  # close-on-exec: no program a child runs inherits it
        except (ImportError, OSError) as exc:  # no inotify (another kernel, the instances limit): poll
            log.info("warmstart preload: no file change notifications (%s); polling imported files", exc)
        for directory in directories.values():
            if self._inotify is not None and directory.path and is_local(directory.path):
                try:
                    wd = self._inotify.add_watch(directory.path, _MASK)
                    # a directory reached by two paths (one through a link) is one watch
                    self._watched[wd] = _merged(self._watched[wd], directory) if wd in self._watched else directory
                    continue
                except OSError:  # gone, unreadable, or the watches limit reached: poll it
                    pass
            self._poll(directory)
        # what changed between the stamps being taken and the watches existing raised no notification
        self.check_all()

    def fileno(self) -> int | None:
        """The descriptor to wait on for change notifications (``None``: none, all files polled)."""
        return None if self._inotify is None else self._inotify.fileno()

    def describe(self) -> dict:
        """How the files are watched, for ``warmstart preload status``."""
        return {
            "watched_directories": len(self._watched),
            "polled_files": len(self._polled_files),
            "polled_directories": len(self._polled_dirs),
            "full_checks": self.full_checks,
        }

    def changed(self, max_age_s: float = 0.0) -> str | None:
        """A path that changed since import, or ``None``. Notifications are read at every call; the
        polled files are checked again when their last check is older than ``max_age_s``."""
        self._read_notifications()
        if self._changed is None and self._full_check:
            self._full_check = False
            self._changed = self.check_all()
        if self._changed is None and time.monotonic() - self._polled_at > max_age_s:
            self._changed = self._check(self._polled_files, self._polled_dirs)
            self._polled_at = time.monotonic()
        return self._changed

    def check_all(self) -> str | None:
        """Check every file and directory now, notifications or not."""
        self.full_checks += 1
        self._changed = self._changed or self._check(list(self._stamps), list(self._entries))
        return self._changed

    def close(self) -> None:
        """Stop watching (a forked child, which has no use for the preloader's notifications)."""
        inotify, self._inotify = self._inotify, None
        if inotify is not None:
            with contextlib.suppress(OSError):  # a descriptor that failed may fail to close too
                inotify.close()

    # -- internals ------------------------------------------------------------------------------------

    def _directories(self) -> dict[str, _Directory]:
        directories: dict[str, _Directory] = {}

        resolved: dict[str, str] = {}

        def at(path: str) -> _Directory:
            return directories.setdefault(path, _Directory(path))

        for path in self._stamps:
            parent, name = os.path.split(path)
            at(parent).files.setdefault(name, []).append(path)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                mode = 0
            if stat.S_ISLNK(mode):
                # a change to what a link points at happens in the directory of its target
                real = os.path.realpath(path)
                is_dir = os.path.isdir(real)
            else:
                if parent not in resolved:
                    resolved[parent] = os.path.realpath(parent) if parent else parent
                real, is_dir = os.path.join(resolved[parent], name), stat.S_ISDIR(mode)
            if is_dir:
                at(path).itself.append(path)
            if real != path:
                real_parent, real_name = os.path.split(real)
                at(real_parent).files.setdefault(real_name, []).append(path)
        for path in self._entries:
            at(path).importable.append(path)
        return directories

    def _poll(self, directory: _Directory) -> None:
        self._polled_files.extend(directory.stamped())
        self._polled_dirs.extend(directory.importable)

    def _read_notifications(self) -> None:
        if self._inotify is None:
            return
        try:
            events = self._inotify.read(timeout=0)
        except OSError as exc:  # cannot happen on a working descriptor; never trust it after one
            log.info("warmstart preload: reading file change notifications failed (%s); polling", exc)
            self._stop_watching()
            return
        for event in events:
            if self._changed is not None:  # read only to empty the queue: the answer stays
                break
            if event.mask & _Q_OVERFLOW:  # changes were lost: check everything once
                self._full_check = True
                continue
            directory = self._watched.get(event.wd)
            if directory is None:
                continue
            if event.mask & _GONE:  # the directory itself is gone or moved: poll what it held
                del self._watched[event.wd]
                self._poll(directory)
                self._changed = self._changed or self._check(directory.stamped(), directory.importable)
                continue
            paths = list(directory.files.get(event.name, ()))
            if not event.name or event.mask & _ENTRIES:
                paths.extend(directory.itself)
            importable = directory.importable if event.mask & _ENTRIES else []
            if paths or importable:
                self._changed = self._changed or self._check(paths, importable)

    def _stop_watching(self) -> None:
        for directory in self._watched.values():
            self._poll(directory)
        self._watched.clear()
        self.close()
        self._full_check = True

    def _check(self, paths: list[str], importable: list[str]) -> str | None:
        changed = next((path for path in paths if stamp(path) != self._stamps[path]), None)
        if changed is None:
            changed = next((path for path in importable if importable_entries(path) != self._entries[path]), None)
        return changed
