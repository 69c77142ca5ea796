"""Single-flight compiles: of the processes that miss the same entry at once, one compiles it and the
others wait for its result instead of compiling it too.

A process that misses an entry (same namespace, key id, kind and key) takes a *lease* on it before it
compiles: a lock file in the local cache directory (``flock``: ranks on one host, with or without a
server), and a key in Redis (``SET NX PX``: every host), renewed every ``ttl_s / 3`` by a background
thread while its holder works. The holder's ``put`` of the entry releases the lease once the entry is
readable in every tier; a compile that raises releases it when the compile ends (see :func:`scope`).
A process that finds the lease taken waits, polling the lease, and then reads the entry. It stops
waiting and compiles itself when:

* the lease is gone and the entry is not there: its holder died (``flock`` is released by the kernel at
  once; a Redis lease lapses ``ttl_s`` after its last renewal), stopped (a lock file its holder has not
  touched for ``ttl_s``), or its compile raised. The waiter takes the lease over and compiles;
* it has waited ``wait_s``, or what is left of the process's budget for waiting (``wait_budget.py``):
  it compiles without a lease;
* the server fails or its breaker is open: it compiles at once.

Lock files exist only while held: the holder removes its file when it releases the lock.

A read-only job (``WARMSTART_CACHE_MODE=ro``, a verify-only key, reader credentials) waits on leases
it sees but never takes one. A lease is held at most ``wait_s``: past that nobody waits for it anyway.

A Redis lease is a record signed with the job's key (the entry, a random token, an expiry), and a
waiter honours only one its own key verifies, for that entry, not expired: a key planted under a
lease's name (with the writer's password alone, without the signing key) is ignored, counted in
``leases_ignored``, and the job compiles. Renewal and release are compare-and-set transactions
(WATCH, GET, MULTI, EXEC): a holder that stalled past its lease's lapse, while another process took
it, finds the lease is not its own any more and neither extends nor deletes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart import _defaults
from warmstart._threads import start_daemon
from warmstart.compile_cache.stats import Stats
from warmstart.compile_cache.storage import Lookup
from warmstart.compile_cache.wait_budget import WaitBudget

if TYPE_CHECKING:
    from warmstart.compile_cache.remote_leases import Leases

log = logging.getLogger("warmstart.cache")

#: Kinds worth waiting for: each is seconds of compiling. Not ``pgo`` (read before compiling, never
#: produced by it) nor ``isa_probe`` (under a second, and every process needs its answer at once).
LEASED_KINDS = frozenset({"fx_graph", "aot_autograd", "cpp_object", "header_digest", "triton_kernel", "autotune"})

#: Kinds torch may store after the compile that missed them has returned: AOTAutograd lowers the
#: backward graph lazily, at the first backward pass, and saves its entry then (see
#: :meth:`SingleFlight.deferred_compile`). A lease of these kinds outlives a scope that ends normally:
#: it is kept while this process compiles anything, and for ``DEFERRED_MIN_S`` after its last compile
#: ended, so that waiters load the entry instead of tracing the joint graph again.
DEFERRED_KINDS = frozenset({"aot_autograd"})
DEFERRED_MIN_S = 5.0


def leased(kind: str, key: str) -> bool:
    """Whether a miss of ``kind``/``key`` takes a lease. Triton's kernels are leased by their group
    file, which Triton looks up first and writes last; the files it groups are written by the holder."""
    if kind == "triton_kernel":
        return key.rsplit("/", 1)[-1].startswith("__grp__")
    return kind in LEASED_KINDS


@dataclass(eq=False)
class Lease:
    """What this process holds for one entry it is compiling."""

    kind: str
    key: str
    token: str
    local_fd: int | None = None
    local_path: Path | None = None
    remote: bool = False
    taken_at: float = field(default_factory=time.monotonic)
    pid: int = field(default_factory=os.getpid)
    release_at: float | None = None
    """When the renewer lets it go, if nothing stored it by then: set when the compile that took it
    returned without storing it (see ``DEFERRED_KINDS``), or for a lease taken outside any compile."""
    saving: bool = False
    """Its entry is being written in the background: only :meth:`SingleFlight.finished` (the write
    readable) releases it, not the end of the compile that stored it."""


class _Held:
    """Another process holds the lease; ``partial``: the part of it this process holds meanwhile (its
    host's lock, while it waits on another host's Redis lease), or ``None``."""

    def __init__(self, partial: Lease | None) -> None:
        self.partial = partial


class SingleFlight:
    """Leases for the store's misses (see the module docstring).

    Args:
        local_dir: the local tier's directory (lock files go in ``leases/`` under it), or ``None``.
        local_writable: whether this process may take local locks (not in read-only mode).
        remote_leases: the remote tier's leases (``RemoteTier.leases``), or ``None``.
        remote_writable: whether this process may take remote leases; a read-only job (a remote tier
            that is not ``writable``) watches them, never takes one.
        stats: where ``leases``, ``waits``, ``wait_s``, ``takeovers``, ``wait_timeouts`` and
            ``leases_lapsed`` (leases let go without their entry, see :meth:`_lapsed`) are counted.
        wait_s: the longest one wait lasts (and a lease is held); 0 turns single-flight off.
        ttl_s: a Redis lease's lifetime without renewal: how soon a dead holder's lease lapses.
        poll_s: the longest pause between two looks at a lease.
        budget: the process's time for waiting on the cache: each wait is charged to it, and none
            starts once it is spent (see ``wait_budget.py``).
    """

    def __init__(
        self,
        *,
        local_dir: Path | None,
        local_writable: bool,
        remote_leases: Leases | None,
        remote_writable: bool,
        stats: Stats,
        wait_s: float = _defaults.COMPILE_WAIT_S,
        ttl_s: float = _defaults.LEASE_TTL_S,
        poll_s: float = _defaults.LEASE_POLL_S,
        budget: WaitBudget | None = None,
    ) -> None:
        self.lock_dir = Path(local_dir) / "leases" if local_dir is not None else None
        self.local_writable = local_writable and self.lock_dir is not None
        self.remote_leases = remote_leases
        self.remote_writable = remote_leases is not None and remote_writable
        self.stats = stats
        self.wait_s = wait_s
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.budget = budget or WaitBudget(_defaults.MAX_WAIT_S)
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], Lease] = {}
        self._renewer: threading.Thread | None = None
        self._renewer_pid = 0
        self._wake = threading.Event()
        self._scopes = threading.local()
        self._compiling = 0  # compile scopes open in this process, in any thread
        self._compiled_at = float("-inf")  # when the last one ended (monotonic)
        _instances.add(self)

    def compiled_within(self, seconds: float) -> bool:
        """Whether a compile scope is open in this process (in any thread), or one ended less than
        ``seconds`` ago."""
        return self._compiling > 0 or time.monotonic() - self._compiled_at < seconds

    # -- the store's side ------------------------------------------------------------------------

    def resolve(
        self,
        kind: str,
        key: str,
        miss: Lookup,
        lookup: Callable[[], Lookup],
        waiting: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> Lookup:
        """After ``miss``: take the lease and return ``miss`` (this process compiles), or wait for the
        process that holds it and return ``lookup()``'s answer once it is done. Never raises, and
        returns within ``wait_s`` (and what is left of the budget) plus one server deadline."""
        if self.wait_s <= 0 or not leased(kind, key) or self.budget.exhausted:
            return miss
        with self._lock:
            if (kind, key) in self._held:  # this process compiles it already (another thread)
                return miss
        with self.budget.waiting("a lease"):
            state = self._take(kind, key)
        if isinstance(state, Lease):
            self._hold(state)
            return miss
        if state is None:
            return miss
        self.stats.bump("waits")
        start = time.monotonic()
        try:
            with waiting():
                return self._wait(kind, key, miss, lookup, state, start)
        finally:
            self.stats.bump("wait_s", round(time.monotonic() - start, 3))
            self.budget.charge(time.monotonic() - start, "another process's compile")

    def _wait(
        self, kind: str, key: str, miss: Lookup, lookup: Callable[[], Lookup], held: _Held, start: float
    ) -> Lookup:
        deadline = start + min(self.wait_s, self.budget.remaining())
        pause = min(0.05, self.poll_s)
        partial = held.partial
        try:
            while True:
                time.sleep(pause)
                pause = min(pause * 1.5, self.poll_s)
                state = self._take(kind, key, partial=partial)
                if isinstance(state, _Held):
                    partial = state.partial
                    if time.monotonic() < deadline:
                        continue
                    self.stats.bump("wait_timeouts")
                    log.info(
                        "warmstart: waited %.0f s for another process's compile of a %s entry; compiling it here",
                        time.monotonic() - start,
                        kind,
                    )
                    return miss
                partial = None
                # The lease is gone: its holder finished (the entry is readable now) or gave up.
                result = lookup()
                if result:
                    if state is not None:
                        self._release(state)
                    return result
                if state is None:  # the server failed: compile at once, without a lease
                    return miss
                self.stats.bump("takeovers")
                self._hold(state)
                return miss
        finally:
            if partial is not None:
                self._release(partial)

    def saving(self, kind: str, key: str) -> None:
        """``kind``/``key`` is stored in the background: keep its lease until :meth:`finished`, so
        that no waiter finds the lease gone before the entry is readable."""
        with self._lock:
            lease = self._held.get((kind, key))
            if lease is not None:
                lease.saving, lease.release_at = True, None

    def finished(self, kind: str, key: str) -> None:
        """The entry is readable in every tier that took it (or will not be): release its lease."""
        with self._lock:
            lease = self._held.pop((kind, key), None)
        if lease is not None:
            self._release(lease, popped=True)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Leases this thread takes inside the body and still holds when it ends are released then:
        a compile that raised (or stored nothing) must not keep others waiting. When the body returns,
        leases of ``DEFERRED_KINDS`` are kept, waiting for torch's deferred save: while any compile of
        this process runs, and ``DEFERRED_MIN_S`` after the last one ended."""
        stack = getattr(self._scopes, "stack", None)
        if stack is None:
            stack = self._scopes.stack = []
        stack.append([])
        with self._lock:
            self._compiling += 1
        failed = True
        try:
            yield
            failed = False
        finally:
            taken: list[Lease] = stack.pop()
            ended: list[Lease] = []
            with self._lock:
                self._compiling -= 1
                now = self._compiled_at = time.monotonic()
                for lease in taken:
                    if self._held.get((lease.kind, lease.key)) is not lease or lease.saving:
                        continue
                    if not failed and lease.kind in DEFERRED_KINDS:
                        lease.release_at = now
                        continue
                    del self._held[(lease.kind, lease.key)]
                    ended.append(lease)
                for lease in self._held.values():  # the time after this process last compiled
                    if lease.kind in DEFERRED_KINDS and lease.release_at is not None:
                        lease.release_at = max(lease.release_at, now + DEFERRED_MIN_S)
            for lease in ended:
                self._release(lease, popped=True)

    @contextlib.contextmanager
    def deferred_compile(self, kind: str, matches: Callable[[str], bool]) -> Iterator[None]:
        """The body is the compile torch deferred for the entries of ``kind`` whose keys ``matches``
        accepts (AOTAutograd's backward, lowered at the first backward pass), which stores them when
        it ends. Their leases, kept since the compile that missed them returned, do not lapse while
        it runs, however long it takes (up to ``wait_s``); those it did not store are released when
        it ends. The body is a :meth:`scope` of its own."""
        with self._lock:
            pinned = [
                lease
                for (held_kind, key), lease in self._held.items()
                if held_kind == kind and lease.release_at is not None and matches(key)
            ]
            for lease in pinned:
                lease.release_at = None
        try:
            with self.scope():
                yield
        finally:
            for lease in pinned:
                if not lease.saving:  # its save releases it once written, or already did
                    self._release(lease)

    def release_all(self) -> None:
        """Release every lease this process holds (at exit)."""
        with self._lock:
            leases, self._held = list(self._held.values()), {}
        for lease in leases:
            self._release(lease, popped=True)

    def holds(self, kind: str, key: str) -> bool:
        """Whether this process holds the lease on ``kind``/``key``."""
        with self._lock:
            return (kind, key) in self._held

    @property
    def held(self) -> int:
        """How many leases this process holds now."""
        with self._lock:
            return len(self._held)

    # -- leases ----------------------------------------------------------------------------------

    def _take(self, kind: str, key: str, partial: Lease | None = None) -> Lease | _Held | None:
        """Take the lease on ``kind``/``key``: a :class:`Lease` when this process may compile it now,
        :class:`_Held` when another one holds it, ``None`` when nobody can be waited for and no lease
        can be taken (a read-only job with the server failing)."""
        lease = partial or Lease(kind, key, secrets.token_hex(8))
        if lease.local_fd is None:
            if self.local_writable:
                fd = self._lock_local(kind, key)
                if fd is False:
                    return _Held(None)
                lease.local_fd = fd if isinstance(fd, int) else None
                lease.local_path = self._lock_path(kind, key) if lease.local_fd is not None else None
            elif self._local_held(kind, key):
                return _Held(None)
        if self.remote_leases is None:
            return lease if lease.local_fd is not None else None
        if self.remote_writable:
            taken = self.remote_leases.take(kind, key, lease.token, self.ttl_s)
            if taken is False:
                return _Held(lease if lease.local_fd is not None else None)
            lease.remote = bool(taken)
        if not lease.remote and self.remote_leases.held(kind, key):  # read-only: watch, never take
            return _Held(lease if lease.local_fd is not None else None)
        if lease.local_fd is None and not lease.remote:
            return None
        return lease

    def _hold(self, lease: Lease) -> None:
        with self._lock:
            self._held[(lease.kind, lease.key)] = lease
        self.stats.bump("leases")
        stack = getattr(self._scopes, "stack", None)
        if stack:
            stack[-1].append(lease)
        else:  # no compile scope will end it: it lasts as a deferred one would, not the whole wait
            lease.release_at = time.monotonic() + 2 * DEFERRED_MIN_S
        if lease.remote or lease.local_fd is not None:
            self._ensure_renewer()

    def _release(self, lease: Lease, popped: bool = False) -> None:
        if not popped:
            with self._lock:
                if self._held.get((lease.kind, lease.key)) is lease:
                    del self._held[(lease.kind, lease.key)]
        if lease.pid != os.getpid():  # a forked child's copy: the parent's to release
            return
        if lease.remote and self.remote_leases is not None:  # only a remote tier's leases are remote
            lease.remote = False
            try:
                self.remote_leases.drop(lease.kind, lease.key, lease.token)
            except Exception:  # it lapses by itself within ttl_s
                log.debug("could not release a lease", exc_info=True)
        fd, lease.local_fd = lease.local_fd, None
        if fd is not None:
            try:
                if lease.local_path is not None and _same_file(fd, lease.local_path):
                    os.unlink(lease.local_path)  # while still locked: a new taker makes a new file
            except OSError:
                pass
            with contextlib.suppress(OSError):
                os.close(fd)  # releases the flock

    def _lock_path(self, kind: str, key: str) -> Path:
        assert self.lock_dir is not None
        return self.lock_dir / (hashlib.sha256(f"{kind}\0{key}".encode()).hexdigest()[:40] + ".lock")

    def _lock_local(self, kind: str, key: str) -> int | bool | None:
        """An fd holding the entry's lock file; False when another process holds it; None when the
        lock cannot be taken (the directory is unusable: no local single-flight then).

        The holder's renewer touches the file every ``ttl_s / 3``. A lock whose file was not touched
        for ``ttl_s`` belongs to a process that stopped (a scheduler's suspend, a debugger, a core
        dump under way; ``flock`` has no lapse of its own): its file is removed and a new one taken,
        as a Redis lease lapses. The holder removes the file when it releases the lock."""
        try:
            self.lock_dir.mkdir(mode=0o700, exist_ok=True)  # type: ignore[union-attr]
        except OSError:
            return None
        path = self._lock_path(kind, key)
        for _ in range(3):
            fd = _try_flock(path, os.O_RDWR | os.O_CREAT, fcntl.LOCK_EX)
            if fd is False:
                if not self._stale(path):
                    return False
                self.stats.bump("stale_locks")
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if fd is None:
                return None
            if _same_file(fd, path):  # not removed by a releasing holder since we opened it
                with contextlib.suppress(OSError):
                    os.utime(fd)
                return fd
            os.close(fd)
        return None

    def _stale(self, path: Path) -> bool:
        try:
            return time.time() - path.stat().st_mtime > self.ttl_s
        except OSError:
            return False

    def _local_held(self, kind: str, key: str) -> bool:
        if self.lock_dir is None:
            return False
        path = self._lock_path(kind, key)
        fd = _try_flock(path, os.O_RDONLY, fcntl.LOCK_SH)
        if isinstance(fd, int) and not isinstance(fd, bool):
            os.close(fd)
            return False
        return fd is False and not self._stale(path)

    # -- renewal ---------------------------------------------------------------------------------

    def _ensure_renewer(self) -> None:
        if self._renewer is not None and self._renewer_pid == os.getpid():
            return
        with self._lock:
            if self._renewer is not None and self._renewer_pid == os.getpid():
                return
            self._renewer_pid = os.getpid()
            self._renewer = start_daemon(self._renew_loop, "warmstart-leases")

    def _renew_loop(self) -> None:
        while True:
            self._wake.wait(self.ttl_s / 3)
            self._wake.clear()
            with self._lock:
                leases = list(self._held.values())
            now = time.monotonic()
            compiling = self._compiling > 0
            expired = [lease for lease in leases if self._lapsed(lease, now, compiling)]
            for lease in expired:  # nobody waits longer than wait_s: holding it longer only misleads
                log.debug("lease on a %s entry held for %.0f s: released", lease.kind, now - lease.taken_at)
                self.stats.bump("leases_lapsed")
                self._release(lease)
            for lease in leases:  # this process is alive: its host locks must not look stale
                if lease not in expired and lease.local_fd is not None:
                    with contextlib.suppress(OSError):
                        os.utime(lease.local_fd)
            remote = [lease for lease in leases if lease.remote and lease not in expired]
            if remote and self.remote_leases is not None:
                try:
                    lost = set(
                        self.remote_leases.renew([(lease.kind, lease.key, lease.token) for lease in remote], self.ttl_s)
                        or ()
                    )
                except Exception:  # the server failed: the leases lapse, waiters compile themselves
                    log.debug("could not renew leases", exc_info=True)
                    lost = set()
                for lease in remote:  # lapsed while this process stalled, and taken by another: not ours
                    if (lease.kind, lease.key) in lost:
                        lease.remote = False

    def _lapsed(self, lease: Lease, now: float, compiling: bool) -> bool:
        """Whether ``lease`` is let go without its entry: held ``wait_s``, or past its ``release_at``
        (for a deferred kind, only while this process compiles nothing)."""
        if now - lease.taken_at > self.wait_s:
            return True
        if lease.release_at is None or now < lease.release_at:
            return False
        return not (compiling and lease.kind in DEFERRED_KINDS)

    def _forget_after_fork(self) -> None:
        # A forked child holds none of its parent's leases; the parent's flock descriptors are
        # closed here (the lock stays with the parent) and its renewer thread does not exist here.
        with contextlib.suppress(Exception):
            for lease in self._held.values():
                if lease.local_fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(lease.local_fd)
        self._held = {}
        self._lock = threading.Lock()
        self._renewer = None
        self._renewer_pid = 0
        self._scopes = threading.local()
        self._compiling = 0
        self._compiled_at = float("-inf")


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` has open."""
    try:
        found, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _try_flock(path: Path, open_flags: int, lock: int) -> int | bool | None:
    """An fd of ``path`` holding ``lock``; False when another process's lock excludes it; None when
    the file cannot be opened or locked."""
    try:
        fd = os.open(path, open_flags | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, lock | fcntl.LOCK_NB)
        return fd
    except OSError as exc:
        os.close(fd)
        return False if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None


_instances: weakref.WeakSet[SingleFlight] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for flight in list(_instances):
        flight._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
