"""Triton's kernel cache over warmstart's store, selected with
``TRITON_CACHE_MANAGER=warmstart.compile_cache.triton_manager:WarmstartCacheManager``.

An environment variable, not ``triton.knobs``, so Inductor's compile workers use it too. Unlike
Triton's ``RemoteCacheManager``, which asks the network on every lookup, this looks on local disk
first and goes to the store only on a local miss; fetched files are written locally so the next
lookup is a file stat. Group files are stored with child *names* (Triton's own store absolute
paths), so an entry is valid on any machine whatever its cache directory. Every name is confined to
the kernel's directory: a cache entry naming ``../x`` or ``/etc/passwd`` is a miss, never a write
elsewhere.

The protocol is Triton's ``FileCacheManager``'s (``triton/runtime/cache.py``), as its ``compile()``
uses it: ``get_group("k.json")`` and ``put_group("k.json", files)`` address the group file
``__grp__k.json``, and ``put`` takes bytes or any object it stores as ``str(data)`` (an IR module
for the ``.ttir`` and ``.ttgir`` stages).
"""

from __future__ import annotations

import json
import os
import weakref
from abc import ABC, abstractmethod
from pathlib import Path

from warmstart._fileio import write_file
from warmstart.compile_cache.storage import fail_open

try:  # Triton checks that the manager class has a base named ``CacheManager``.
    from triton.runtime.cache import CacheManager
except ImportError:  # CPU-only installs: the same interface, so the manager is usable and tested

    class CacheManager(ABC):  # type: ignore[no-redef]
        """Triton's cache-manager interface (``triton/runtime/cache.py``)."""

        # Triton's base class has this no-op constructor too (B027: empty, not abstract, on purpose).
        def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:  # noqa: B027
            pass

        @abstractmethod
        def get_file(self, filename: str) -> str | None: ...

        @abstractmethod
        def put(self, data, filename: str, binary: bool = True) -> str: ...

        @abstractmethod
        def get_group(self, filename: str) -> dict[str, str] | None: ...

        @abstractmethod
        def put_group(self, filename: str, group: dict[str, str]) -> None: ...


KIND = "triton_kernel"


def plain_name(name: object) -> bool:
    """Whether ``name`` is a bare file name, so that joined to a directory it stays inside it: no
    separator, not ``.`` or ``..``, no NUL (which would also make ``open`` raise)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\0" not in name
        and not any(sep in name for sep in ("/", "\\", os.sep, os.altsep or "/"))
    )


def _require_plain(name: str) -> None:
    # Names from Triton itself: a bad one is a caller bug, not a cache fault.
    if not plain_name(name):
        raise ValueError(f"not a plain file name: {name!r}")


def _group_name(filename: str) -> str:
    """The file that lists a kernel's files: ``__grp__<metadata file>``, as Triton names it."""
    return f"__grp__{filename}"


def triton_cache_dir() -> Path:
    """Triton's local cache directory: ``TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache``."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or os.path.expanduser("~")) / ".triton" / "cache"


class WarmstartCacheManager(CacheManager):
    """Local directory first, then warmstart's store (remote tier included).

    Args:
        key: Triton's kernel key (base32 of its hash); the local directory and the store key prefix.
        override, dump: Triton's override and dump managers stay purely local, as in Triton.
    """

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        super().__init__(key, override, dump)
        self.key = key
        self._shared = not (override or dump)
        if override:
            base = Path(os.environ.get("TRITON_OVERRIDE_DIR") or triton_cache_dir().parent / "override")
        elif dump:
            base = Path(os.environ.get("TRITON_DUMP_DIR") or triton_cache_dir().parent / "dump")
        else:
            base = triton_cache_dir()
        self.cache_dir = str(base / key)
        os.makedirs(self.cache_dir, exist_ok=True)

    def _store(self):
        if not self._shared:
            return None
        from warmstart.compile_cache import get_store

        return get_store()

    def _local(self, filename: str) -> str:
        return os.path.join(self.cache_dir, filename)

    def get_file(self, filename: str) -> str | None:
        if not plain_name(filename):  # e.g. a child name read from a group entry
            return None
        path = self._local(filename)
        if os.path.exists(path):
            return path
        try:
            store = self._store()
            data = store.get(KIND, f"{self.key}/{filename}").value if store is not None else None
            if data is None:
                if store is not None and filename.startswith("__grp__"):
                    self._lease_ends_with_me(store, f"{self.key}/{filename}")
                return None
        except Exception as exc:  # the shared tier's fault costs this lookup, never Triton's compile
            fail_open("Triton kernel cache read", exc)
            return None
        if filename.startswith("__grp__"):
            data = self._localize_group(data)
            if data is None:
                return None
        return self._write(filename, data)

    def put(self, data, filename: str, binary: bool = True) -> str:
        _require_plain(filename)
        # As Triton's own managers: bytes as they are, anything else (text, an IR module) as its str().
        data = bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else str(data).encode()
        path = self._write(filename, data)
        self._share(filename, data)
        return path

    def get_group(self, filename: str) -> dict[str, str] | None:
        if not plain_name(filename):
            return None
        grp_path = self.get_file(_group_name(filename))
        if grp_path is None:
            return None
        try:
            with open(grp_path) as f:
                children = json.load(f)["child_paths"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(children, dict):
            return None
        result = {}
        for name in children:
            path = self.get_file(name)
            if path is None:  # a child evicted or never written: the group is unusable
                return None
            result[name] = path
        return result

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        for name in (filename, *group):
            _require_plain(name)
        grp_name = _group_name(filename)
        local = {"child_paths": {name: self._local(name) for name in group}}
        path = self._write(grp_name, json.dumps(local).encode())
        portable = {"child_paths": {name: os.path.basename(child) for name, child in group.items()}}
        self._share(grp_name, json.dumps(portable).encode())
        return path

    def _share(self, filename: str, data: bytes) -> None:
        try:
            store = self._store()
            if store is not None:
                store.put(KIND, f"{self.key}/{filename}", data)
        except Exception as exc:  # the file is written locally; only sharing it is lost
            fail_open("Triton kernel cache write", exc)

    def _lease_ends_with_me(self, store, key: str) -> None:
        # Triton creates one manager per compile and calls nothing on it when the compile raises:
        # a lease this miss took (single-flight) ends with the manager at the latest, so that a
        # failed compile never keeps other processes waiting. ``put_group`` releases it first.
        flight = getattr(store, "single_flight", None)
        if flight is not None and flight.holds(KIND, key):
            weakref.finalize(self, flight.finished, KIND, key)

    def _localize_group(self, data: bytes) -> bytes | None:
        try:
            children = json.loads(data)["child_paths"]
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(children, dict) or not all(plain_name(name) for name in children):
            return None  # an entry naming files outside this kernel's directory: a miss
        return json.dumps({"child_paths": {name: self._local(name) for name in children}}).encode()

    def _write(self, filename: str, data: bytes) -> str:
        # Same protocol as Triton's FileCacheManager: write to a private temp file, then rename.
        path = self._local(filename)
        write_file(Path(path), data, 0o644)
        return path
