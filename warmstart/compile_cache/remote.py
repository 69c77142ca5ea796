"""The remote tier: Redis (one node, TLS, or a Redis Cluster) behind signed, content-addressed entries.

Layout under the key prefix ``ws:<namespace>:``:

* ``p:<kind>:<key id>:<key>``: a pointer record signed with the job's secret (see ``signing.py``;
  the key id names the secret, so jobs with different secrets never touch each other's records).
  Values of up to 64 KiB (compressed) live inside it: one round trip to read, one to write;
* ``b:{<blake3>}:<i>``: chunk ``i`` of a larger zstd-compressed blob, split under Redis value limits.
  The digest is a hash tag, so all chunks of a blob live in one Cluster slot and come back in one
  pipelined round trip;
* ``l:<kind>:<key id>:<key>``: the lease of a process compiling that entry now (``remote_leases.py``);
* ``index``: the names of every pointer and chunk this namespace's writers stored (for ``cache clear``).

Identical large artifacts under different keys are stored once. Writes are ``SET NX``: the first
writer wins when processes race (except for ``REPLACED_KINDS``, whose entries grow: the last wins). Chunk keys
are predictable, so a chunk that was already there is
read back and overwritten unless it holds exactly the intended bytes; readers check every chunk's
length against the signed size before fetching or joining anything.

Every operation has a deadline for the whole of it (``REMOTE_OP_DEADLINE_S`` plus the value's size
at ``REMOTE_MIN_BYTES_PER_S``), and failures open a circuit breaker: see ``remote_client.py``.

This module holds the entries (get, put, delete, clear). :class:`RemoteTier` is a
:class:`~warmstart.compile_cache.remote_client.RemoteConnection`, which owns the client, the
deadlines and the breaker, with the namespace registry mixed in
(:class:`~warmstart.compile_cache.remote_registry.RemoteRegistry`: ``cache explain`` and ``doctor``
call it as methods of the tier). Its leases are an object that holds the connection
(:attr:`RemoteTier.leases`, a :class:`~warmstart.compile_cache.remote_leases.Leases`): only
single-flight takes leases, and it holds that object, so a read-only view of the tier need not
carry them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import redis
import zstandard

from warmstart import _defaults
from warmstart.compile_cache import signing
from warmstart.compile_cache.fetch_ahead import (
    AHEAD_ABSENT,
    AHEAD_HITS,
    AHEAD_REJECTED,
    MANIFEST,
    FetchAhead,
    Fetched,
    ManifestEntry,
)
from warmstart.compile_cache.keyspace import KEY_PREFIX, REGISTRY_KEY
from warmstart.compile_cache.remote_client import (
    UNREACHABLE,
    as_bytes,
    bounded,
    connect,
    deadline,
    extend_deadline,
)
from warmstart.compile_cache.remote_leases import Leases
from warmstart.compile_cache.remote_registry import RemoteRegistry
from warmstart.compile_cache.stats import Stats
from warmstart.compile_cache.storage import (
    ABSENT,
    BREAKER_OPEN,
    ERROR,
    EVICTED,
    REJECTED,
    REPLACED_KINDS,
    TIMEOUT,
    Hit,
    Lookup,
    Miss,
    warn_once,
)
from warmstart.config import url_options
from warmstart.errors import IntegrityError

__all__ = ["KEY_PREFIX", "REGISTRY_KEY", "RemoteTier", "connect"]

log = logging.getLogger("warmstart.cache")

_COMPRESS_MIN = 1024
_PROBE_BYTES = 64 * 1024  # compress this much first; skip compressing what does not shrink
_PROBE_ABOVE = 1024 * 1024  # below this, compressing everything costs less than probing first
#: The most a signed pointer record holds besides its inline value: magic, signature, header.
_POINTER_HEADER_MAX = 4096


class RemoteTier(RemoteRegistry):
    """Signed, content-addressed artifacts in Redis.

    Args:
        url: ``redis://``, ``rediss://`` or ``redis+cluster://`` URL (credentials in the URL). Query
            options: redis-py's TLS and timeout options, and ``compress=`` (a zstd level, default
            -3, or ``off``) for the values this process writes; readers handle either.
        keys: what entries are signed and verified with (``signing.Ed25519Keys`` from
            ``WARMSTART_KEY_FILE``, or ``signing.HmacKeys``); entries that do not verify under them
            are never returned. Keys that cannot sign (a public key only) make a tier that never
            writes, whatever the URL's credentials allow.
        secret: shorthand for ``keys=signing.HmacKeys(secret)``.
        namespace: compatibility namespace (see ``namespace.py``); keys never cross namespaces.
        components: what ``namespace`` is made of (``namespace.components``): registered on the
            server after the first write, so that ``warmstart cache explain`` can compare machines.
        stats: where to count; a private ``Stats`` when omitted.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        keys: signing.Keys | None = None,
        secret: bytes | None = None,
        namespace: str,
        components: Mapping[str, str] | None = None,
        stats: Stats | None = None,
        ttl_s: int = _defaults.REMOTE_TTL_S,
        chunk_bytes: int = _defaults.CHUNK_BYTES,
        inline_bytes: int = _defaults.INLINE_BYTES,
    ) -> None:
        if keys is None:
            if not secret:
                raise ValueError("RemoteTier needs keys or a non-empty secret")
            keys = signing.HmacKeys(secret)
        elif secret is not None:
            raise ValueError("RemoteTier takes keys or secret, not both")
        super().__init__(url, keys=keys, namespace=namespace, stats=stats)
        self.components = components
        self._ttl_s = ttl_s
        self._chunk_bytes = chunk_bytes
        self._inline_bytes = inline_bytes
        self._registered = False
        self._rejected_logged = False
        self._error_logged = False
        options = url_options(url)
        level = options.get("compress", _defaults.COMPRESS_LEVEL)
        self._level: int | None = level if isinstance(level, int) else None
        self._codecs = threading.local()
        self.leases = Leases(self)
        """Leases on this namespace's entries, over this tier's connection (see ``single_flight.py``)."""
        self.ahead: FetchAhead | None = None
        """This process's fetch ahead (see ``fetch_ahead.py``): lookups take what it fetched."""

    @property
    def writable(self) -> bool:
        """Whether ``put`` may store: not with keys that can only verify. Credentials the server
        turns out to refuse writes to are found by the first write, which is then refused."""
        return self.keys.can_sign

    # python-zstandard's compressors and decompressors must not be used by two threads at once (it
    # crashes the process): the job's threads and the background writer each get their own.
    @property
    def _zc(self) -> zstandard.ZstdCompressor | None:
        """This thread's compressor; ``None`` when the URL says ``compress=off``."""
        if self._level is None:
            return None
        zc = getattr(self._codecs, "zc", None)
        if zc is None:
            zc = self._codecs.zc = zstandard.ZstdCompressor(level=self._level)
        return zc

    @property
    def _zd(self) -> zstandard.ZstdDecompressor:
        """This thread's decompressor."""
        zd = getattr(self._codecs, "zd", None)
        if zd is None:
            zd = self._codecs.zd = zstandard.ZstdDecompressor()
        return zd

    # -- keys --------------------------------------------------------------------------------
    def _pointer_key(self, kind: str, key: str) -> str:
        return f"{self._prefix}p:{kind}:{self.key_id}:{key}"

    @property
    def _index_key(self) -> str:
        """A set of the names of every pointer and chunk this namespace's writers stored: what
        ``cache clear`` and ``doctor`` walk, so that writers need no SCAN (which would show them the
        names of every key on the server, in one call of any size)."""
        return f"{self._prefix}index"

    def _chunk_keys(self, digest: str, chunks: int) -> list[str]:
        return [f"{self._prefix}b:{{{digest}}}:{i}" for i in range(chunks)]

    # -- Storage -----------------------------------------------------------------------------
    def get(self, kind: str, key: str, *, wait: bool = True, copy_local: bool = True) -> Lookup:
        """A :class:`Hit` (with the producer's cost), or a :class:`Miss`: ``absent``, ``evicted`` (the
        record is there, a chunk of its blob is not), ``rejected`` (does not verify: never returned),
        ``breaker_open`` (not asked: the server failed recently), ``timeout`` (this lookup's deadline
        passed) or ``error`` (this lookup failed otherwise, or the tier is closed). Never raises.

        An entry fetched ahead (:attr:`ahead`) is taken from memory, verified as a reply would be;
        one that does not verify is looked up again, as if it had not been fetched."""
        fetched = self.ahead.take(kind, key) if self.ahead is not None else None
        if fetched is not None:
            result = self._get(kind, key, fetched)
            if result is not None:
                return result
        result = self._get(kind, key, None)
        return result if result is not None else Miss(ERROR, self.name, "no reply")

    @bounded
    def _get(self, kind: str, key: str, fetched: Fetched | None) -> Lookup | None:
        """``get``, from the server or from what was ``fetched`` ahead (``None`` then when that does
        not verify: the caller asks the server)."""
        if self.closed:
            self.stats.add(self.name, kind, misses=1)
            return Miss(ERROR, self.name, "the tier is closed")
        if not self.breaker.allow():
            self.stats.add(self.name, kind, misses=1)
            return Miss(BREAKER_OPEN, self.name, "breaker open (the server failed recently)")
        start = time.perf_counter()
        try:
            record = fetched.record if fetched is not None else self._read_pointer(self._pointer_key(kind, key))
            if record is None:
                self.stats.add(self.name, kind, misses=1, read_s=time.perf_counter() - start)
                if fetched is not None:
                    self.stats.bump(AHEAD_ABSENT)
                return Miss(ABSENT, self.name)
            pointer, inline = self.keys.verify(record, namespace=self.namespace, kind=kind, key=key)
            loaded = self._load(pointer, inline, fetched)
            if loaded is None:  # blob evicted before its pointer
                self.stats.add(self.name, kind, misses=1, read_s=time.perf_counter() - start)
                return Miss(EVICTED, self.name, f"{pointer.chunks} chunk(s) of a {pointer.size}-byte blob")
            blob, value = loaded
        except IntegrityError as exc:
            if fetched is not None:  # not what the server holds now, perhaps: ask it
                self.stats.bump(AHEAD_REJECTED)
                log.debug("warmstart: an entry fetched ahead did not verify (%s); looking it up", exc)
                return None
            self.stats.add(self.name, kind, rejected=1, misses=1)
            if not self._rejected_logged:
                log.warning("warmstart: rejected a remote %s entry: %s (treated as a miss)", kind, exc)
                self._rejected_logged = True
            return Miss(REJECTED, self.name, str(exc))
        except Exception as exc:
            self._failed(kind, exc)
            # Time lost waiting on a failing server is part of what the cache cost the job.
            self.stats.add(self.name, kind, read_s=time.perf_counter() - start)
            reason = TIMEOUT if isinstance(exc, redis.exceptions.TimeoutError) else ERROR
            return Miss(reason, self.name, f"{type(exc).__name__}: {exc}")
        elapsed = time.perf_counter() - start
        self.stats.add(
            self.name, kind, hits=1, bytes_read=len(blob), read_s=elapsed, saved_s=max(0.0, pointer.cost_s - elapsed)
        )
        if fetched is not None:
            self.stats.bump(AHEAD_HITS)
        if self.ahead is not None:
            self.ahead.saw(kind, key, pointer)
        return Hit(value, self.name, pointer.cost_s)

    def _load(
        self, pointer: signing.Pointer, inline: bytes, fetched: Fetched | None = None
    ) -> tuple[bytes, bytes] | None:
        """The blob of a verified pointer (inline, or its chunks: from what was ``fetched`` ahead
        when that is this blob, else from the server) and the value in it; ``None`` when a chunk is
        missing.

        Raises:
            IntegrityError: a chunk of the wrong length, or a blob that is not the one signed for.
        """
        blob = inline
        if pointer.chunks:
            chunked = None
            if fetched is not None and fetched.digest == pointer.digest and fetched.replies:
                chunked = self._join_blob(pointer, fetched.replies)
            if chunked is None:
                chunked = self._read_blob(pointer)
            if chunked is None:
                return None
            blob = chunked
        return blob, self._zd.decompress(blob) if pointer.compressed else blob

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0, sync: bool = False) -> bool:
        # A verify-only key cannot sign, whatever the URL's credentials allow.
        if not self.keys.can_sign or self._write_refused or not self._available():
            self.stats.add(self.name, kind, dropped=1)
            return False
        try:
            pointer = self._write(kind, key, value, cost_s, replace=kind in REPLACED_KINDS)
        except Exception as exc:
            self._failed(kind, exc, writing=True)
            return False
        self.stats.add(self.name, kind, writes=1, bytes_written=pointer.size)
        if self.ahead is not None:
            self.ahead.saw(kind, key, pointer)
        if not self._registered:
            self.register()
        return True

    def _write(self, kind: str, key: str, value: bytes, cost_s: float, *, replace: bool) -> signing.Pointer:
        """Store one entry (``replace``: over an entry already there, else the first writer wins);
        the signed pointer it was stored under. Raises what the server raised."""
        blob, compressed = self._compress(value)
        pkey = self._pointer_key(kind, key)
        if len(blob) <= self._inline_bytes:
            pointer = signing.Pointer(self.namespace, kind, key, "", len(blob), 0, compressed, cost_s)
            record, chunk_keys = self.keys.sign(pointer, blob), []
        else:
            digest = signing.blob_digest(blob)
            chunk_keys = self._chunk_keys(digest, -(-len(blob) // self._chunk_bytes))
            pointer = signing.Pointer(self.namespace, kind, key, digest, len(blob), len(chunk_keys), compressed, cost_s)
            record = self.keys.sign(pointer)
        with deadline(self.op_deadline_s + len(blob) / self.min_bytes_per_s):
            # One round trip: the blob's chunks, then the pointer. A reader that finds the pointer
            # before the chunks (another Cluster node) sees a miss, never a wrong value.
            pipe = self._client.pipeline(transaction=False)
            view = memoryview(blob)  # chunks without copies
            chunks = [view[i * self._chunk_bytes : (i + 1) * self._chunk_bytes] for i in range(len(chunk_keys))]
            for ckey, chunk in zip(chunk_keys, chunks, strict=True):
                pipe.set(ckey, chunk, nx=True, ex=self._ttl_s)
            pipe.set(pkey, record, nx=not replace, ex=self._ttl_s)
            pipe.sadd(self._index_key, pkey, *chunk_keys)  # what `cache clear` deletes, without SCAN
            results = pipe.execute()[:-1]  # the chunks' SET NX, then the pointer's
            existing = [(k, c) for k, c, done in zip(chunk_keys, chunks, results[:-1], strict=True) if not done]
            if existing:
                self._check_chunks(existing)
            if not results[-1]:
                self._repair_pointer(pkey, record, kind, key, pointer)
        return pointer

    # -- fetched ahead (fetch_ahead.py) ------------------------------------------------------------
    @bounded
    def read_manifest(self, name: str) -> bytes | None:
        """The manifest stored under ``name``, verified; ``None`` when there is none.

        Raises:
            IntegrityError: it does not verify under this tier's keys.
            redis.exceptions.RedisError, OSError: the server failed.
        """
        record = self._read_pointer(self._pointer_key(MANIFEST, name))
        if record is None:
            return None
        pointer, inline = self.keys.verify(record, namespace=self.namespace, kind=MANIFEST, key=name)
        loaded = self._load(pointer, inline)
        return loaded[1] if loaded is not None else None

    @bounded
    def write_manifest(self, name: str, value: bytes) -> bool:
        """Store the manifest ``name`` over the one there; False when this tier does not write now.

        Raises:
            redis.exceptions.RedisError, OSError: the server failed.
        """
        if not self.keys.can_sign or self._write_refused or not self._available():
            return False
        self._write(MANIFEST, name, value, 0.0, replace=True)
        return True

    @bounded
    def fetch_entries(self, entries: Sequence[ManifestEntry], max_bytes: int) -> dict[tuple[str, str], Fetched]:
        """Every entry of ``entries`` in one pipelined exchange: its pointer record, and its blob's
        chunks where the entry names the blob; then, in a second, the chunks of the blobs whose
        records name another (at most ``max_bytes`` of blobs in all). Each record is checked here only
        to know which chunks to fetch: a lookup verifies what it takes.

        Raises:
            redis.exceptions.RedisError, OSError: the server failed.
        """
        cap = self._inline_bytes + _POINTER_HEADER_MAX
        extend_deadline(sum(e.size for e in entries) / self.min_bytes_per_s)
        pipe = self._client.pipeline(transaction=False)
        for entry in entries:
            pipe.getrange(self._pointer_key(entry.kind, entry.key), 0, cap)
            if entry.chunks:
                self._ask_chunks(pipe, entry.digest, entry.chunks, self._chunk_cap(entry.size, entry.chunks))
        replies = pipe.execute()
        fetched: dict[tuple[str, str], Fetched] = {}
        others: list[tuple[ManifestEntry, bytes, signing.Pointer]] = []  # records naming another blob
        budget = max_bytes - sum(e.size for e in entries)
        i = 0
        for entry in entries:
            record = as_bytes(replies[i]) or None
            chunk_replies = list(replies[i + 1 : i + 1 + 2 * entry.chunks])
            i += 1 + 2 * entry.chunks
            if record is not None and len(record) > cap:
                continue  # no pointer record is that large: the lookup finds why
            fetched[(entry.kind, entry.key)] = Fetched(record, entry.digest, chunk_replies)
            if record is None:
                continue
            try:
                pointer, _ = self.keys.verify(record, namespace=self.namespace, kind=entry.kind, key=entry.key)
            except IntegrityError:
                continue
            if pointer.chunks and pointer.digest != entry.digest and pointer.size <= budget:
                budget -= pointer.size
                others.append((entry, record, pointer))
        if others:
            extend_deadline(sum(p.size for _, _, p in others) / self.min_bytes_per_s)
            pipe = self._client.pipeline(transaction=False)
            for _, _, pointer in others:
                self._ask_chunks(pipe, pointer.digest, pointer.chunks, self._chunk_cap(pointer.size, pointer.chunks))
            replies = pipe.execute()
            i = 0
            for entry, record, pointer in others:
                n = 2 * pointer.chunks
                fetched[(entry.kind, entry.key)] = Fetched(record, pointer.digest, list(replies[i : i + n]))
                i += n
        return fetched

    def fetch_failed(self, exc: Exception) -> None:
        """A fetch ahead failed: a server that cannot serve opens the breaker, as a lookup's failure
        would; anything else is logged once at debug level (the lookups go on as before)."""
        if isinstance(exc, UNREACHABLE):
            self.breaker.trip(f"{type(exc).__name__}: {exc}")
        else:
            log.debug("warmstart: fetch ahead failed (%s: %s)", type(exc).__name__, exc)

    def _read_pointer(self, pkey: str) -> bytes | None:
        """A pointer record, or ``None`` when there is none. Never more than a pointer can be: one
        GETRANGE of at most the inline size plus the header, so a planted oversize value costs its
        first bytes, not its length.

        Raises:
            IntegrityError: the value under the pointer's name is larger than any pointer record.
        """
        cap = self._inline_bytes + _POINTER_HEADER_MAX
        record = as_bytes(self._client.getrange(pkey, 0, cap))
        if not record:
            return None
        if len(record) > cap:
            raise IntegrityError(f"the value under a pointer's name is over {cap} bytes: no pointer record is")
        return record

    def _compress(self, value: bytes) -> tuple[bytes, bool]:
        if self._zc is None or len(value) < _COMPRESS_MIN:
            return value, False
        if len(value) > _PROBE_ABOVE:  # machine code that is already packed: do not pay for nothing
            probe = self._zc.compress(value[:_PROBE_BYTES])
            if len(probe) > 0.9 * _PROBE_BYTES:
                return value, False
        blob = self._zc.compress(value)
        return (blob, True) if len(blob) < len(value) else (value, False)

    def _read_blob(self, pointer: signing.Pointer) -> bytes | None:
        """The chunked blob ``pointer`` names, or ``None`` when a chunk is missing (evicted).

        Chunk lengths are checked against the signed size before anything is joined, and no chunk is
        fetched past what that size allows: a planted oversize chunk costs its length, not its bytes.

        Raises:
            IntegrityError: a chunk of the wrong length, or a blob that is not the one signed for.
        """
        n = pointer.chunks
        extend_deadline(pointer.size / self.min_bytes_per_s)
        cap = self._chunk_cap(pointer.size, n)
        if cap < 1:  # GETRANGE 0 -1 would fetch everything
            raise IntegrityError(f"signed pointer names {n} chunks for a {pointer.size}-byte blob")
        pipe = self._client.pipeline(transaction=False)
        self._ask_chunks(pipe, pointer.digest, n, cap)
        return self._join_blob(pointer, pipe.execute())

    def _ask_chunks(self, pipe, digest: str, n: int, cap: int) -> None:
        """Queue on ``pipe`` the length and the first ``cap`` bytes of each of a blob's ``n`` chunks."""
        for ckey in self._chunk_keys(digest, n):
            pipe.strlen(ckey)
            pipe.getrange(ckey, 0, cap - 1)

    @staticmethod
    def _chunk_cap(size: int, n: int) -> int:
        """The most bytes any chunk of a ``size``-byte blob in ``n`` chunks can hold. The writer's
        chunk size is not signed, but the size and count bound it: all chunks but the last have one
        length L, with (n - 1) * L < size <= n * L."""
        return size if n == 1 else -(-size // (n - 1)) - 1

    def _join_blob(self, pointer: signing.Pointer, replies: list) -> bytes | None:
        """The blob from the replies :meth:`_ask_chunks` queued, or ``None`` when a chunk is missing.

        Raises:
            IntegrityError: a chunk of the wrong length, or a blob that is not the one signed for.
        """
        if len(replies) != 2 * pointer.chunks:
            raise IntegrityError(f"{len(replies) // 2} chunk replies for a blob of {pointer.chunks} chunks")
        n = pointer.chunks
        lengths, parts = replies[0::2], replies[1::2]
        if not all(lengths):
            return None
        first = lengths[0]
        if (
            any(length != len(part) for length, part in zip(lengths, parts, strict=True))
            or sum(lengths) != pointer.size
            or any(length != first for length in lengths[:-1])
            or lengths[-1] > first
        ):
            raise IntegrityError(
                f"blob chunks of {pointer.size}-byte blob have lengths {lengths[:4]}"
                f"{'...' if n > 4 else ''}, not what its signed pointer allows"
            )
        blob = parts[0] if n == 1 else b"".join(parts)
        signing.check_blob(pointer, blob)
        return blob

    def _check_chunks(self, existing: list[tuple[str, memoryview]]) -> None:
        # Chunks that were there before our SET NX: the same blob stored under another key, a racing
        # writer, or bytes planted at this predictable key by someone without the secret, which would
        # make every reader reject the entry until it expires. Keep those holding exactly our bytes,
        # overwrite the rest. (Not EXPIRE to renew the kept ones: the writer's ACL does not allow it;
        # a kept chunk that expires before its pointer is a miss that the next write repairs.)
        extend_deadline(sum(len(c) for _, c in existing) / self.min_bytes_per_s)
        pipe = self._client.pipeline(transaction=False)
        for ckey, chunk in existing:
            pipe.strlen(ckey)
            pipe.getrange(ckey, 0, len(chunk) - 1)  # never more than ours, whatever was planted
        replies = pipe.execute()
        fix = self._client.pipeline(transaction=False)
        planted = 0
        for (ckey, chunk), length, held in zip(existing, replies[0::2], replies[1::2], strict=True):
            if length != len(chunk) or held != chunk:
                fix.set(ckey, chunk, ex=self._ttl_s)
                planted += 1
        if planted:
            fix.execute()
            warn_once(
                "remote-planted-chunk",
                "warmstart: %d remote blob chunk(s) held bytes other than their "
                "content address names; overwritten (someone without the secret wrote to the cache?)",
                planted,
            )

    def _repair_pointer(self, pkey: str, record: bytes, kind: str, key: str, ours: signing.Pointer) -> None:
        # First writer wins, unless the existing pointer is unusable (its blob was evicted or damaged,
        # or it does not verify: the key id in its name is our secret's, so it was damaged or
        # tampered with): then ours replaces it.
        try:
            existing = self._read_pointer(pkey)
            old, _ = self.keys.verify(existing or b"", namespace=self.namespace, kind=kind, key=key)
            # Same blob as ours: its chunks were just written or checked. Else read it back.
            if old.chunks == 0 or old.digest == ours.digest or self._read_blob(old) is not None:
                return
        except IntegrityError:
            pass
        self._client.set(pkey, record, ex=self._ttl_s)

    def _failed(self, kind: str, exc: Exception, writing: bool = False) -> None:
        if self._no_permission(exc):
            if writing:  # read-only credentials: stop trying to write, keep reading
                self._write_refused = True
                self.stats.add(self.name, kind, dropped=1)
                log.warning("warmstart: remote cache credentials are read-only; not writing to it")
            else:
                self.stats.add(self.name, kind, errors=1, misses=1)
            return
        if isinstance(exc, redis.exceptions.TimeoutError):
            self.stats.add(self.name, kind, timeouts=1, **({} if writing else {"misses": 1}))
        else:
            self.stats.add(self.name, kind, errors=1, **({} if writing else {"misses": 1}))
        if isinstance(exc, UNREACHABLE):
            self.breaker.trip(f"{type(exc).__name__}: {exc}")
        elif not self._error_logged:  # not the server's state: worth one line, never a failure
            self._error_logged = True
            log.warning(
                "warmstart: remote %s %s failed (%s: %s); treated as a miss",
                kind,
                "write" if writing else "read",
                type(exc).__name__,
                exc,
            )

    def delete(self, kind: str, key: str) -> bool:
        """Remove one entry's pointer (its blob, shared by content, is left to LRU eviction)."""
        name = self._pointer_key(kind, key)
        self._client.srem(self._index_key, name)
        return bool(self._client.unlink(name))

    def key_ids(self, limit: int = 10_000) -> dict[str, int]:
        """Pointer records of this namespace per signing key id, over at most ``limit`` keys.

        Entries under another key id were written by jobs holding another secret; this job never
        reads them (``warmstart cache doctor`` reports them).
        """
        counts: dict[str, int] = {}
        for n, name in enumerate(self._client.sscan_iter(self._index_key, match=f"{self._prefix}p:*", count=1000)):
            if n >= limit:
                break
            parts = (name.decode() if isinstance(name, bytes) else name)[len(self._prefix) :].split(":", 3)
            if len(parts) == 4:
                counts[parts[2]] = counts.get(parts[2], 0) + 1
        return counts

    def clear(self) -> int:
        """Delete every entry of this namespace (the pointers and chunks its index names, then the
        index); returns how many keys were deleted. Leases lapse by themselves."""
        deleted = 0
        batch: list[str] = []
        for key in self._client.sscan_iter(self._index_key, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += self._delete(batch)
                batch = []
        if batch:
            deleted += self._delete(batch)
        self._client.unlink(self._index_key)
        self._unregister()
        return deleted

    def _delete(self, keys: list) -> int:
        if isinstance(self._client, redis.Redis):
            return int(self._client.unlink(*keys))
        return sum(int(self._client.unlink(k)) for k in keys)  # cluster: keys span slots
