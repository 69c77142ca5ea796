"""Fetch ahead: the remote entries a program will look up, fetched in one pipelined exchange while
it imports the compiler, so that a machine far from the cache server waits on no round trip of its
own, rather than one or two per entry.

A warm start looks up 20 to 80 entries (FX graphs, AOTAutograd entries, C++ objects, probes) one
after another, a round trip or two each: at 50 ms from the server that is seconds. So a process
that writes to the shared cache records which entries it looked up, in order, and at exit stores
them as a signed *manifest* named after its program (the entry script or module, as torch's PGO
state is: ``entry_point.py``) when they differ from the manifest it found. A later process of the
same program, on any machine, starts a thread when it imports Dynamo, or at its first compile
(``compile_cache.fetch_ahead_now``): one read of the manifest, then one pipeline
(``GETRANGE``/``STRLEN``, never ``MGET``) for every entry it names, pointer records and blob chunks
together; a second one only for blobs the manifest did not name. Its lookups then take their
entries from memory and verify them as they would a reply.

What it costs when wrong: an entry the manifest did not predict is looked up as before; one that
does not verify, or whose blob changed, is looked up again; a manifest that does not verify, a
failed fetch, or a fetch past its deadline leaves every lookup to the server as before. A lookup
waits for the fetch no longer than the fetch's own deadline, nor than what is left of the process's
time for waiting on the cache; the bytes held are bounded (``FETCH_AHEAD_BYTES``), and a lookup
takes its entry out of memory.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from warmstart import _defaults
from warmstart._threads import start_daemon
from warmstart.compile_cache.wait_budget import WaitBudget

log = logging.getLogger("warmstart.cache")

MANIFEST = "manifest"
"""The kind manifests are stored under (beside the entries, in the same namespace and key id)."""
_FORMAT = 1

# Counters (``Stats.counters``): entries fetched ahead; lookups served from them (a hit, or the
# absence the fetch saw); fetched entries that did not verify (looked up again); seconds lookups
# waited for the fetch; fetches that failed.
AHEAD_FETCHED = "fetched_ahead"
AHEAD_HITS = "fetched_ahead_hits"
AHEAD_ABSENT = "fetched_ahead_absent"
AHEAD_REJECTED = "fetched_ahead_rejected"
AHEAD_WAIT_S = "fetch_ahead_wait_s"
AHEAD_FAILED = "fetch_ahead_failed"


class ManifestEntry(NamedTuple):
    """One entry a program looked up: its kind and key, and its blob when it has one (the digest,
    chunk count and size of the signed pointer last seen; ``""``, 0, 0 when unknown or inline)."""

    kind: str
    key: str
    digest: str = ""
    chunks: int = 0
    size: int = 0


class Fetched(NamedTuple):
    """What the server held for one entry when it was fetched: the pointer record (``None``: none),
    and the replies for the chunks of the blob named ``digest`` (empty: not fetched). Unverified."""

    record: bytes | None
    digest: str
    replies: list


class _Tier(Protocol):
    """What fetching ahead needs of the remote tier (``remote.RemoteTier``)."""

    op_deadline_s: float
    min_bytes_per_s: float

    @property
    def stats(self): ...

    def read_manifest(self, name: str) -> bytes | None: ...

    def write_manifest(self, name: str, value: bytes) -> bool: ...

    def fetch_entries(self, entries: Sequence[ManifestEntry], max_bytes: int) -> dict[tuple[str, str], Fetched]: ...

    def fetch_failed(self, exc: Exception) -> None: ...


def encode(entries: Sequence[ManifestEntry]) -> bytes:
    """A manifest's stored form."""
    return json.dumps({"format": _FORMAT, "entries": [list(e) for e in entries]}, separators=(",", ":")).encode()


def decode(data: bytes) -> list[ManifestEntry]:
    """The entries of a stored manifest.

    Raises:
        ValueError: not a manifest of this format.
    """
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("entries"), list):
        raise ValueError("not a manifest of format 1")
    entries = []
    for item in doc["entries"]:
        if not (
            isinstance(item, list)
            and len(item) == 5
            and all(isinstance(x, str) for x in item[:3])
            and all(isinstance(x, int) and x >= 0 for x in item[3:])
        ):
            raise ValueError(f"a manifest entry is not [kind, key, digest, chunks, size]: {item!r:.80}")
        entries.append(ManifestEntry(*item))
    return entries


class FetchAhead:
    """The fetch ahead of one process, for the remote tier ``tier`` and the program ``name``.

    Args:
        tier: the remote tier the entries come from (and the manifest goes to, when it can write).
        name: what the manifest is stored under: the program (see ``entry_point.py``).
        writes: whether this process stores its manifest (it writes to the tier).
        budget: the process's time for waiting on the cache (``wait_budget.py``): a lookup waits for
            the fetch no longer than what is left of it (the store charges the wait to it).
        max_entries: the most entries a manifest names (the most recently looked up kept).
        max_bytes: the most bytes of blobs one fetch moves and holds.
    """

    def __init__(
        self,
        tier: _Tier,
        name: str,
        *,
        writes: bool = False,
        budget: WaitBudget | None = None,
        max_entries: int = _defaults.FETCH_AHEAD_ENTRIES,
        max_bytes: int = _defaults.FETCH_AHEAD_BYTES,
    ) -> None:
        self.tier = tier
        self.name = name
        self.writes = writes
        self.budget = budget
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._started = False
        self._ran = False
        self._deadline = 0.0  # time.monotonic() by which the fetch has ended, whatever happens
        self._known = threading.Event()  # the manifest was read (or could not be)
        self._done = threading.Event()  # the entries were fetched (or could not be)
        self._found: list[ManifestEntry] = []  # the manifest as read
        self._predicted: frozenset[tuple[str, str]] = frozenset()
        self._fetched: dict[tuple[str, str], Fetched] = {}
        self._looked_up: dict[tuple[str, str], None] = {}  # this process's lookups, in order
        self._pointers: dict[tuple[str, str], tuple[str, int, int]] = {}  # blobs seen this process

    # -- the fetch -----------------------------------------------------------------------------
    def begin(self) -> bool:
        """Mark the fetch as under way, so that lookups wait for it from now on (its deadline starts
        now); False when it had begun already in this process."""
        with self._lock:
            if self._started:
                return False
            self._started = True
            # The manifest's read and the entries' fetch are each one operation of the tier: each
            # ends within its deadline, plus its bytes at the tier's slowest accepted rate.
            bound = 2 * self.tier.op_deadline_s + 2 * self.max_bytes / self.tier.min_bytes_per_s
            self._deadline = time.monotonic() + bound
            return True

    def start(self) -> bool:
        """:meth:`begin` the fetch and :meth:`run` it on a thread of its own; False when it had begun."""
        if not self.begin():
            return False
        start_daemon(self.run, "warmstart-fetch-ahead")
        return True

    def run(self) -> None:
        """Fetch on this thread (begun first if it was not), once per process; never raises."""
        from warmstart.compile_cache.remote_client import fetching_ahead

        self.begin()
        with self._lock:
            if self._ran:
                return
            self._ran = True
        fetching_ahead()
        try:
            chosen = self._within_bounds(self._read_found())
            with self._lock:
                self._predicted = frozenset((e.kind, e.key) for e in chosen)
            self._known.set()
            if chosen:
                fetched = self.tier.fetch_entries(chosen, self.max_bytes)
                with self._lock:
                    self._fetched = fetched
                self.tier.stats.bump(AHEAD_FETCHED, len(fetched))
        except Exception as exc:  # a fault costs the fetch, never a lookup: they ask the server
            with self._lock:
                self._predicted = frozenset()
                self._fetched = {}
            self.tier.stats.bump(AHEAD_FAILED)
            self.tier.fetch_failed(exc)
        finally:
            self._known.set()
            self._done.set()

    def _read_found(self) -> list[ManifestEntry]:
        """Read the manifest stored for this program (none: empty) and keep it as the one found."""
        data = self.tier.read_manifest(self.name)
        found = decode(data) if data else []
        with self._lock:
            self._found = found
        return found

    def _within_bounds(self, entries: list[ManifestEntry]) -> list[ManifestEntry]:
        chosen, total = [], 0
        for entry in entries[: self.max_entries]:
            if total + entry.size > self.max_bytes:
                continue
            total += entry.size
            chosen.append(entry)
        return chosen

    def take(self, kind: str, key: str) -> Fetched | None:
        """What was fetched for this entry (once: a second lookup asks the server), waiting for the
        fetch if it is under way and the manifest names the entry; ``None`` when the entry is not
        fetched ahead."""
        if os.getpid() != self._pid:  # a forked child: the fetch, and its thread, are the parent's
            return None
        if not self._started:
            return None
        start = time.monotonic()
        end = self._deadline if self.budget is None else min(self._deadline, start + self.budget.remaining())
        if not self._known.wait(max(0.0, end - start)):
            return None
        if (kind, key) not in self._predicted:
            return None
        if not self._done.wait(max(0.0, end - time.monotonic())):
            return None
        waited = time.monotonic() - start
        if waited > 1e-3:
            self.tier.stats.bump(AHEAD_WAIT_S, waited)
        with self._lock:
            return self._fetched.pop((kind, key), None)

    # -- the manifest ----------------------------------------------------------------------------
    def looked_up(self, kind: str, key: str) -> None:
        """Note a lookup of this process (any tier), for the manifest it may store at exit."""
        if len(self._looked_up) < self.max_entries:
            self._looked_up.setdefault((kind, key))

    def saw(self, kind: str, key: str, pointer) -> None:
        """Note the signed pointer of an entry this process read or wrote (its blob, for the manifest)."""
        self._pointers[(kind, key)] = (pointer.digest, pointer.chunks, pointer.size)

    def manifest(self) -> list[ManifestEntry]:
        """The manifest this process would store: its own lookups first, in order, then those of the
        manifest it found that it did not look up, at most ``max_entries``."""
        found = {(e.kind, e.key): e for e in self._found}
        entries = []
        for kind, key in list(self._looked_up):
            blob = self._pointers.get((kind, key))
            if blob is None:
                old = found.get((kind, key))
                blob = (old.digest, old.chunks, old.size) if old is not None else ("", 0, 0)
            entries.append(ManifestEntry(kind, key, *blob))
        mine = set(self._looked_up)
        entries += [e for e in self._found if (e.kind, e.key) not in mine]
        return entries[: self.max_entries]

    def save(self) -> bool:
        """Store :meth:`manifest` when this process can write to the tier and its lookups differ from
        the manifest it found (new entries, or blobs that changed); True when stored. Never raises."""
        if os.getpid() != self._pid or not self._looked_up or not self.writes:
            return False
        if self._started and not self._known.is_set():
            return False  # the manifest it found is not known yet: storing could only lose entries
        try:
            if not self._started:  # a process that never compiled: keep what the manifest holds
                self._read_found()
        except Exception as exc:
            log.debug("warmstart: could not read the fetch-ahead manifest: %s: %s", type(exc).__name__, exc)
            return False
        entries = self.manifest()
        found = {(e.kind, e.key): e for e in self._found}
        if all(found.get((e.kind, e.key)) == e for e in entries[: len(self._looked_up)]):
            return False
        try:
            return self.tier.write_manifest(self.name, encode(entries))
        except Exception as exc:  # the next writer stores it
            log.debug("warmstart: could not store the fetch-ahead manifest: %s: %s", type(exc).__name__, exc)
            return False
