"""The storage interface every tier implements, and the artifact kinds warmstart caches.

Read this first. A tier maps ``(kind, key)`` to bytes. ``get`` answers a :class:`Hit` or a
:class:`Miss` that says why (a :class:`MissReason`) and never raises: any failure is a miss,
counted in the tier's stats. Read-only is a wrapper (:class:`ReadOnly`), and every store says
whether it takes writes (``writable``): callers ask it, never its type. The tiered store is built
from and typed against :class:`Storage`, and reports what it did to :class:`StoreObserver` s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import threading
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from warmstart.compile_cache.signing import Keys
    from warmstart.compile_cache.stats import Stats

log = logging.getLogger("warmstart.cache")

#: Artifact kinds, as shown in ``warmstart cache stats``.
KINDS: dict[str, str] = {
    "fx_graph": "fx graph",
    "aot_autograd": "aot autograd",
    "autotune": "autotune",
    "pgo": "pgo",
    "triton_kernel": "triton kernel",
    "cpp_object": "compiled C++ object",
    "header_digest": "preprocessed header digest",
    "isa_probe": "vector ISA probe",
    "dynamo_frames": "dynamo frames",
    "sharding_plan": "sharding plan",
    "background_compile": "background compile",
}

#: Kinds whose entry under a key grows (Dynamo's frames for a function, as more are compiled): a
#: write replaces the entry. For every other kind the key names the content, and the first writer wins.
REPLACED_KINDS = frozenset({"dynamo_frames"})


class MissReason(str, enum.Enum):
    """Why a lookup missed. A ``str``: it compares equal to, and is written to JSON as, its value."""

    ABSENT = "absent"
    """No entry under this key in this tier."""
    EVICTED = "evicted"
    """The entry's record is there but its blob was evicted (the server ran out of memory)."""
    OTHER_KEY_ID = "other_key_id"
    """The entry exists, signed with another key (another secret or key pair): this job cannot use it."""
    REJECTED = "rejected"
    """The entry failed verification (bad signature or checksum, damaged chunks): never handed to torch."""
    OTHER_NAMESPACE = "other_namespace"
    """The entry exists for another namespace (torch version, CPU ISA, Python ABI, GPU arch, user namespace)."""
    BREAKER_OPEN = "breaker_open"
    """The tier was not asked: it is off after a failure (the remote tier's circuit breaker is open, the
    local database is damaged or stayed locked)."""
    TIMEOUT = "timeout"
    """The lookup ran out of time: its deadline or lock wait passed, or the process's time for waiting
    on the cache was spent."""
    ERROR = "error"
    """The lookup failed otherwise (a refused connection, a permission, an I/O error, a closed tier)."""

    # The value, not ``MissReason.ABSENT``, in messages and f-strings, on every Python version.
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


ABSENT = MissReason.ABSENT
EVICTED = MissReason.EVICTED
OTHER_KEY_ID = MissReason.OTHER_KEY_ID
REJECTED = MissReason.REJECTED
OTHER_NAMESPACE = MissReason.OTHER_NAMESPACE
BREAKER_OPEN = MissReason.BREAKER_OPEN
TIMEOUT = MissReason.TIMEOUT
ERROR = MissReason.ERROR

MISS_REASONS = tuple(MissReason)
"""Why a lookup missed, from the most to the least common in a healthy fleet."""

SKIPPED = "skipped"
"""Not a reason a lookup gives: the sum of :data:`SKIPPED_REASONS` in the JSON that counts misses by
reason (kept for readers from before they were told apart), and what older miss logs recorded."""
SKIPPED_REASONS = (BREAKER_OPEN, TIMEOUT, ERROR)
"""The reasons that say the tier was not asked, or not answered: what ``skipped`` adds up."""


@dataclasses.dataclass(frozen=True, slots=True)
class Hit:
    """A value found in ``tier``; ``cost_s`` is what producing it cost (for "seconds saved")."""

    value: bytes
    tier: str
    cost_s: float = 0.0

    reason: ClassVar[None] = None

    def __bool__(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class Miss:
    """No usable value: ``reason`` says why, ``detail`` says more in words
    (e.g. ``breaker open``, ``signed with key 3fa9c2e1``)."""

    reason: MissReason
    tier: str
    detail: str = ""

    value: ClassVar[None] = None

    def __bool__(self) -> bool:
        return False


Lookup = Hit | Miss
"""What :meth:`Storage.get` answers."""


@runtime_checkable
class Storage(Protocol):
    """A byte store keyed by artifact kind and key: each tier, a read-only view of one, and the
    tiered store built from them. What the tiered store and single-flight use of a tier is all here."""

    name: str
    """Short name used in stats: ``local``, ``remote`` (a tiered store: ``store``)."""

    stats: Stats
    """Where the tier counts; a tiered store sets its own on its tiers, so all count in one place."""

    @property
    def writable(self) -> bool:
        """Whether :meth:`put` may store anything; False for a read-only view (or a tiered store of
        read-only tiers), whose every ``put`` is refused. Fixed when the store is built: True does
        not promise that a write succeeds (a tier may still refuse one, counted)."""
        ...

    def get(self, kind: str, key: str, *, wait: bool = True, copy_local: bool = True) -> Lookup:
        """A :class:`Hit`, or a :class:`Miss` that says why. Never raises: an error is a miss
        (``timeout`` or ``error``), counted in the stats; so is a lookup after :meth:`close`.

        Args:
            kind: the artifact kind (a key of :data:`KINDS`).
            key: the entry's key within ``kind``.
            wait: whether a miss may wait for another process that is compiling the entry, and
                take a lease on it (single-flight); False for values cheaper to make again than to
                wait for. A single tier never waits.
            copy_local: whether a hit from a farther tier is copied into a nearer one; False for a
                value the caller keeps on this machine itself. A single tier has nothing to copy.
        """
        ...

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0, sync: bool = False) -> bool:
        """Store ``value``; ``cost_s`` is what producing it cost (for "seconds saved").

        Args:
            sync: whether every tier is written before this returns, rather than some from a
                background thread. A single tier always writes before it returns.

        Returns:
            True if stored (or already present, or queued), False if the tier refused or failed (counted).
        """
        ...

    def close(self) -> None:
        """Release what the tier holds open; later calls miss and refuse. Idempotent, never raises."""
        ...


class _Signed(Storage, Protocol):
    """A storage whose entries are signed: the remote tier."""

    keys: Keys
    key_id: str


_S = TypeVar("_S", bound=Storage)
_SignedS = TypeVar("_SignedS", bound=_Signed)


class ReadOnly(Generic[_S]):
    """``storage`` that never writes: ``put`` is refused (counted as ``dropped``), ``get`` passes
    through. What ``WARMSTART_CACHE_MODE=ro`` and a verify-only key make of a tier.

    Only the :class:`Storage` contract is forwarded, plus the keys of a signed tier (which jobs it
    reads the entries of); anything else, such as the remote tier's leases, is on ``storage``."""

    writable = False

    def __init__(self, storage: _S) -> None:
        self.storage: _S = storage
        self.name: str = storage.name

    @property
    def stats(self) -> Stats:
        """The wrapped tier's counters, so that a store can share one set across tiers."""
        return self.storage.stats

    @stats.setter
    def stats(self, stats: Stats) -> None:
        self.storage.stats = stats

    def get(self, kind: str, key: str, *, wait: bool = True, copy_local: bool = True) -> Lookup:
        return self.storage.get(kind, key, wait=wait, copy_local=copy_local)

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0, sync: bool = False) -> bool:
        self.storage.stats.add(self.name, kind, dropped=1)
        return False

    def close(self) -> None:
        self.storage.close()

    @property
    def keys(self: ReadOnly[_SignedS]) -> Keys:
        """The signed tier's signing or verifying keys."""
        return self.storage.keys

    @property
    def key_id(self: ReadOnly[_SignedS]) -> str:
        """The signed tier's key id."""
        return self.storage.key_id


class StoreObserver(Protocol):
    """What a store tells the rest of warmstart about its work (the metrics package attaches one
    that turns waits on the shared tier into ETT spans). Implementations must be cheap and must
    not raise."""

    def waiting(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """Wraps the time a lookup waits on a shared (remote) tier."""
        ...

    def looked_up(self, kind: str, key: str, result: Lookup) -> None:
        """Called once per store lookup with its outcome."""
        ...

    # Optional: ``waiting_on_peer(kind)``, a context manager wrapping the time a lookup waits for
    # another process that is compiling the entry (single-flight); observers without it are skipped.


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(cause: str, message: str, *args: object) -> None:
    """Log ``message`` as a warning the first time ``cause`` comes up in this process, at debug level
    after that. A cache fault never fails a job, and costs its log one line, not one per lookup."""
    with _warned_lock:
        first = cause not in _warned
        _warned.add(cause)
    log.log(logging.WARNING if first else logging.DEBUG, message, *args)


_hook_failed = False


def fail_open(where: str, exc: BaseException) -> None:
    """Warn once per process that warmstart's part of a hooked torch call raised (later failures, in
    any hook, are logged at debug level); the caller then does what torch does without warmstart."""
    global _hook_failed
    if _hook_failed:
        log.debug("warmstart: %s failed", where, exc_info=True)
        return
    _hook_failed = True
    log.warning(
        "warmstart: %s failed (%s: %s); torch compiles without the cache where it fails "
        "(further failures are logged at debug level)",
        where,
        type(exc).__name__,
        exc,
        exc_info=log.isEnabledFor(logging.DEBUG),
    )
