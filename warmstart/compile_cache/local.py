"""The local tier: a diskcache directory with a size limit, least recently used entries out first.

diskcache is SQLite plus files, safe across processes. Its lock wait is kept short
(``LOCAL_LOCK_TIMEOUT_S``) so a busy disk costs a miss, never a stall, and a database that stays locked
past it (its holder stopped or stuck) turns the tier off for the process. Torch runs what this tier holds, so
its directory is private: created
with mode 0700, and refused by ``open_store`` (:func:`check_private`) when another user owns it or
others can write it, unless it is shared on purpose (``WARMSTART_CACHE_DIR_SHARED=1``).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

import diskcache

from warmstart import _defaults
from warmstart.compile_cache.stats import Stats
from warmstart.compile_cache.storage import ABSENT, BREAKER_OPEN, ERROR, TIMEOUT, Hit, Lookup, Miss, warn_once

log = logging.getLogger("warmstart.cache")


class UnsafeCacheDir(Exception):
    """The local cache directory can be written by someone other than this process's user."""


def check_private(directory: Path | str) -> None:
    """Raise :class:`UnsafeCacheDir` unless ``directory`` and its ``store`` subdirectory (where they
    exist) belong to this process's user and no one else can write them: whoever can write them
    runs code in every job that reads this tier."""
    uid = os.geteuid()
    for path in (Path(directory), Path(directory) / "store"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if st.st_uid != uid:
            raise UnsafeCacheDir(f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})")
        if st.st_mode & 0o022:
            raise UnsafeCacheDir(f"{path} is writable by group or others (mode {st.st_mode & 0o7777:o})")


def _locked(exc: BaseException) -> bool:
    """SQLite's lock stayed taken past diskcache's timeout."""
    if isinstance(exc, diskcache.Timeout):
        return True
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def _corrupt(exc: BaseException) -> bool:
    # "file is not a database", "database disk image is malformed": plain DatabaseError. Its
    # subclasses (OperationalError: locked, busy, I/O) can pass, so they only cost a miss.
    return type(exc) is sqlite3.DatabaseError


class LocalTier:
    """Artifacts in ``directory`` (diskcache), at most ``size_limit`` bytes.

    Keys hold the store's ``namespace`` and signing ``key_id``, as the remote tier's do: processes
    of other namespaces (another torch or CPU, another ``WARMSTART_NAMESPACE``) or keys that share a
    directory (a home directory on NFS, say) never read each other's entries.
    """

    name = "local"
    writable = True

    def __init__(
        self,
        directory: Path | str,
        size_limit: int,
        stats: Stats | None = None,
        *,
        namespace: str = "",
        key_id: str = "",
    ) -> None:
        self.directory = Path(directory)
        self.size_limit = size_limit
        self._prefix = f"{namespace}:{key_id}:"
        self.stats = stats or Stats()
        self._off = False
        self._closed = False
        # Private from the start (diskcache would make them 0755). Path.mkdir applies ``mode`` to
        # the last part only, hence two calls.
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.directory / "store").mkdir(mode=0o700, exist_ok=True)
        self._cache = diskcache.Cache(
            str(self.directory / "store"),
            size_limit=size_limit,
            eviction_policy="least-recently-used",
            timeout=_defaults.LOCAL_LOCK_TIMEOUT_S,
            disk_min_file_size=64 * 1024,
        )

    def get(self, kind: str, key: str, *, wait: bool = True, copy_local: bool = True) -> Lookup:
        """A :class:`Hit`, or a :class:`Miss`: ``absent``; ``breaker_open`` when the tier is off
        (damaged, or locked too long before); ``timeout`` when this lookup waited out the lock;
        ``error`` when it failed otherwise (an I/O error) or the tier is closed. Never raises."""
        if self._off or self._closed:
            self.stats.add(self.name, kind, misses=1)
            if self._closed:
                return Miss(ERROR, self.name, "the tier is closed")
            return Miss(BREAKER_OPEN, self.name, "local tier off (damaged, or locked by another process)")
        start = time.perf_counter()
        try:
            item = self._cache.get(f"{self._prefix}{kind}:{key}", default=None, tag=True)
        except Exception as exc:  # diskcache.Timeout, sqlite errors, a full disk
            self.stats.add(self.name, kind, errors=1, misses=1)
            self._failed("get", exc)
            return Miss(TIMEOUT if _locked(exc) else ERROR, self.name, f"{type(exc).__name__}: {exc}")
        value, cost = item if item is not None else (None, None)
        if value is None:
            self.stats.add(self.name, kind, misses=1)
            return Miss(ABSENT, self.name)
        elapsed = time.perf_counter() - start
        self.stats.add(
            self.name, kind, hits=1, bytes_read=len(value), read_s=elapsed, saved_s=max(0.0, (cost or 0.0) - elapsed)
        )
        return Hit(bytes(value), self.name, cost or 0.0)

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0, sync: bool = False) -> bool:
        if self._off or self._closed:
            self.stats.add(self.name, kind, dropped=1)
            return False
        try:
            # The producer's cost rides along as the entry's tag for the "seconds saved" estimate.
            self._cache.set(f"{self._prefix}{kind}:{key}", value, tag=round(cost_s, 4))
        except Exception as exc:
            self.stats.add(self.name, kind, errors=1)
            self._failed("put", exc)
            return False
        self.stats.add(self.name, kind, writes=1, bytes_written=len(value))
        return True

    def _failed(self, op: str, exc: Exception) -> None:
        if _locked(exc):
            # Held past the lock timeout: by a process that is stopped (a scheduler's suspend, a
            # debugger) or stuck. Every later call would wait as long again: off for this process.
            self._off = True
            warn_once(
                f"local-locked:{self.directory}",
                "warmstart: local cache tier off for this process: its "
                "database in %s stayed locked for %.1f s (another process holds it: a stopped or stuck job?)",
                self.directory / "store",
                _defaults.LOCAL_LOCK_TIMEOUT_S,
            )
            return
        if not _corrupt(exc):
            log.debug("local tier %s failed: %s", op, exc)
            return
        # A damaged database fails every call the same way: one line, then the tier stays off.
        self._off = True
        warn_once(
            f"local-corrupt:{self.directory}",
            "warmstart: local cache tier off: %s is damaged (%s: %s); remove it to start afresh",
            self.directory / "store",
            type(exc).__name__,
            exc,
        )

    def delete(self, kind: str, key: str) -> bool:
        """Remove one entry; True if it was there."""
        return bool(self._cache.delete(f"{self._prefix}{kind}:{key}"))

    def volume(self) -> int:
        """Bytes on disk."""
        return self._cache.volume()

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> int:
        """Remove every entry; returns how many were removed."""
        return self._cache.clear()

    def close(self) -> None:
        """Close the database; later lookups miss and writes are refused. Idempotent, never raises."""
        self._closed = True
        try:
            self._cache.close()
        except Exception as exc:  # a damaged database may fail to close too
            log.debug("local tier close failed: %s", exc)
