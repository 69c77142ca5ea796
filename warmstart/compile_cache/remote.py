"""The remote tier: Redis (one node, TLS, or a Redis Cluster) behind signed, content-addressed entries.

Layout under the key prefix ``ws:<namespace>:``:

* ``p:<kind>:<key id>:<key>``: a pointer record signed with the job's secret (see ``signing.py``;
  the key id names the secret, so jobs with different secrets never touch each other's records).
  Values of up to 64 KiB (compressed) live inside it: one round trip to read, one to write;
* ``b:{<blake3>}:<i>``: chunk ``i`` of a larger zstd-compressed blob, split under Redis value limits.
  The digest is a hash tag, so all chunks of a blob live in one Cluster slot and come back in one
  pipelined round trip;
* ``l:<kind>:<key id>:<key>``: the lease of a process compiling that entry now (see
  ``single_flight.py``): a random token, expiring unless its holder renews it.

Identical large artifacts under different keys are stored once. Writes are ``SET NX``: the first
writer wins when processes race (except for ``REPLACED_KINDS``, whose entries grow: the last wins). Chunk keys
are predictable, so a chunk that was already there is
read back and overwritten unless it holds exactly the intended bytes; readers check every chunk's
length against the signed size before fetching or joining anything.

Every operation has a deadline for the whole of it (``REMOTE_OP_DEADLINE_S`` plus the value's size
at ``REMOTE_MIN_BYTES_PER_S``), not just per socket read, and the first failure (a timeout, a refused
connection, an unreachable cluster) opens a circuit breaker, so a slow, stalled or dead server costs
a job at most one deadline.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import zstandard
from redis.backoff import NoBackoff
from redis.retry import Retry

from warmstart import _defaults
from warmstart.compile_cache import signing
from warmstart.compile_cache.breaker import CircuitBreaker
from warmstart.compile_cache.stats import Stats
from warmstart.compile_cache.storage import (
    ABSENT,
    EVICTED,
    REJECTED,
    REPLACED_KINDS,
    SKIPPED,
    Hit,
    Lookup,
    Miss,
    warn_once,
)
from warmstart.config import url_options, validate_cache_url
from warmstart.errors import IntegrityError

log = logging.getLogger("warmstart.cache")

KEY_PREFIX = "ws:"
_COMPRESS_MIN = 1024
_PROBE_BYTES = 64 * 1024  # compress this much first; skip compressing what does not shrink
_PROBE_ABOVE = 1024 * 1024  # below this, compressing everything costs less than probing first
REGISTRY_KEY = KEY_PREFIX + "registry"
"""A hash: one field per namespace and signing key id that wrote to this server (``<namespace>/<key
id>``), holding the namespace's components as JSON. ``warmstart cache explain`` reads it to name
what differs between this machine and the entries the server holds, without scanning keys."""
#: The most a signed pointer record holds besides its inline value: magic, signature, header.
_POINTER_HEADER_MAX = 4096
_REGISTRY_MAX_FIELDS = 1000  # a larger registry is not read: explaining must stay cheap for the server
#: Failures that say the server (or cluster) cannot serve now: they open the circuit breaker.
_UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
    redis.exceptions.RedisClusterException,  # "cannot be connected", SlotNotCoveredError
    redis.exceptions.ClusterError,
)  # ClusterDownError, MasterDownError

# -- deadlines ---------------------------------------------------------------------------------
# redis-py's socket_timeout bounds each socket read: a server that sends one byte just before each
# read would time out stalls a call for as long as it likes. Every remote operation therefore sets a
# deadline for this thread, and the client's sockets (wrapped as they connect) time out at it.

_op = threading.local()  # .deadline: time.monotonic() by which this thread's remote operation ends
_T = TypeVar("_T")


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Bound this thread's remote calls in the block to ``seconds`` in all (an enclosing, earlier
    deadline still holds)."""
    outer = getattr(_op, "deadline", None)
    end = time.monotonic() + seconds
    _op.deadline = end if outer is None else min(outer, end)
    try:
        yield
    finally:
        _op.deadline = outer


def _extend_deadline(seconds: float) -> None:
    """Give the current operation ``seconds`` more: for moving a value once its size is known."""
    if getattr(_op, "deadline", None) is not None:
        _op.deadline += seconds


def _bounded(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run a :class:`RemoteTier` method under the tier's operation deadline, and tell the tier how
    much of its deadline it took (slow is a fault too: see :meth:`RemoteTier._took`)."""

    @functools.wraps(method)
    def bounded(self: "RemoteTier", *args, **kwargs) -> _T:
        start = time.monotonic()
        outer = getattr(_op, "deadline", None)
        allowance = self.op_deadline_s
        try:
            with _deadline(self.op_deadline_s):
                try:
                    return method(self, *args, **kwargs)
                finally:
                    allowance = _op.deadline - start  # with what the value's size added
        finally:
            if outer is None:  # the outermost operation of this thread
                self._took(time.monotonic() - start, allowance)

    return bounded


class _DeadlineSocket:
    """A connected socket whose reads and writes time out at the calling thread's deadline (and,
    as before, after the connection's own timeout per call). Past it, redis-py sees an ordinary
    socket timeout: it drops the connection and raises ``TimeoutError``; no thread is left waiting."""

    __slots__ = ("_sock", "_timeout")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()

    def _arm(self) -> None:
        deadline = getattr(_op, "deadline", None)
        if deadline is None:
            self._sock.settimeout(self._timeout)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("warmstart: remote operation deadline passed")
        self._sock.settimeout(remaining if self._timeout is None else min(self._timeout, remaining))

    def recv(self, *args):
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args):
        self._arm()
        return self._sock.recv_into(*args)

    def send(self, *args):
        self._arm()
        return self._sock.send(*args)

    def sendall(self, *args):
        self._arm()  # since Python 3.5 a timeout bounds the whole sendall
        return self._sock.sendall(*args)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def setblocking(self, flag: bool) -> None:
        self.settimeout(None if flag else 0.0)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def _bound_socket(connection) -> None:
    # Before the handshake (AUTH, HELLO), so that is bounded too. redis-py has no socket factory
    # hook: the connected socket is swapped in place, and its parser binds to it in on_connect().
    if not isinstance(connection._sock, _DeadlineSocket):
        connection._sock = _DeadlineSocket(connection._sock)


def _on_connect(connection) -> None:
    _bound_socket(connection)
    connection.on_connect()


class _Cluster(redis.RedisCluster):
    """RedisCluster whose node connections are deadline-bound (it runs ``on_connect`` for each)."""

    def on_connect(self, connection) -> None:
        _bound_socket(connection)
        super().on_connect(connection)


def connect(
    url: str,
    *,
    connect_timeout: float = _defaults.REMOTE_CONNECT_TIMEOUT_S,
    socket_timeout: float = _defaults.REMOTE_SOCKET_TIMEOUT_S,
) -> redis.Redis | redis.RedisCluster:
    """A redis-py client for a warmstart URL, with short timeouts and no retries (the breaker decides).

    Cluster clients connect lazily on first use, like single-node ones.
    """
    validate_cache_url(url)
    options = url_options(url)
    options.pop("compress", None)  # warmstart's own option: redis-py must not see it
    parts = urlsplit(url)
    url = urlunsplit(parts._replace(query=""))  # redis-py gets the options as arguments instead
    common = dict(
        socket_connect_timeout=options.pop("socket_connect_timeout", connect_timeout),
        socket_timeout=options.pop("socket_timeout", socket_timeout),
    )
    if not parts.scheme.endswith("+cluster"):
        return redis.Redis.from_url(
            url,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            redis_connect_func=_on_connect,
            **common,
            **options,
        )
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes = []
    for hostport in hosts.split(","):
        host, _, port = hostport.rpartition(":")
        nodes.append(redis.cluster.ClusterNode(host, int(port)))
    return _LazyCluster(
        startup_nodes=nodes,
        username=unquote(username) or None,
        password=unquote(password) or None,
        ssl=parts.scheme.startswith("rediss"),
        retry=Retry(NoBackoff(), 0),
        cluster_error_retry_attempts=0,
        **common,
        **options,
    )


class _LazyCluster:
    """RedisCluster connects in its constructor; this defers that to the first command, so that
    building a store never blocks and a dead cluster fails inside the breaker's guard."""

    def __init__(self, **kwargs: object) -> None:
        self._kwargs = kwargs
        self._client: redis.RedisCluster | None = None

    def __getattr__(self, name: str):
        if self._client is None:
            import warnings

            with warnings.catch_warnings():  # cluster_error_retry_attempts is deprecated but still honoured
                warnings.simplefilter("ignore")
                self._client = _Cluster(**self._kwargs)
        return getattr(self._client, name)


class RemoteTier:
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
    op_deadline_s: float = _defaults.REMOTE_OP_DEADLINE_S
    """Seconds one operation may take, plus its value's size at ``min_bytes_per_s``."""
    min_bytes_per_s: float = _defaults.REMOTE_MIN_BYTES_PER_S

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
        self.url = url
        self.namespace = namespace
        self.components = components
        self.stats = stats or Stats()
        self.keys = keys
        self._ttl_s = ttl_s
        self._chunk_bytes = chunk_bytes
        self._inline_bytes = inline_bytes
        self._client = connect(url)
        self._prefix = f"{KEY_PREFIX}{namespace}:"
        self.key_id = keys.key_id
        self._write_refused = False  # the server said NOPERM to a write: read-only credentials
        self._registered = False
        self._rejected_logged = False
        self._error_logged = False
        self.breaker = CircuitBreaker(self._probe, name="remote")
        self._slow_in_a_row = 0
        self._level = url_options(url).get("compress", _defaults.COMPRESS_LEVEL)
        self._codecs = threading.local()

    def _took(self, elapsed_s: float, allowance_s: float) -> None:
        """A server that answers every operation just inside its deadline would cost each lookup
        most of that deadline, forever, without ever failing one: ``SLOW_IN_A_ROW`` operations in a
        row that took more than ``SLOW_SHARE`` of their deadline open the breaker, as a failure does."""
        if elapsed_s <= _defaults.REMOTE_SLOW_SHARE * allowance_s:
            self._slow_in_a_row = 0
            return
        self._slow_in_a_row += 1
        if self._slow_in_a_row >= _defaults.REMOTE_SLOW_IN_A_ROW:
            self._slow_in_a_row = 0
            self.stats.bump("slow_trips")
            self.breaker.trip(
                f"{_defaults.REMOTE_SLOW_IN_A_ROW} operations in a row took over "
                f"{_defaults.REMOTE_SLOW_SHARE:.0%} of their deadline, the last {elapsed_s:.2f} s"
            )

    def _probe(self) -> None:
        """The breaker's health check: a PING that answers, and fast (a slow server stays off)."""
        start = time.monotonic()
        with _deadline(self.op_deadline_s):
            self.ping()
        elapsed = time.monotonic() - start
        if elapsed > _defaults.REMOTE_SLOW_SHARE * self.op_deadline_s:
            raise TimeoutError(f"PING took {elapsed:.2f} s")

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
    @_bounded
    def get(self, kind: str, key: str) -> Lookup:
        """A :class:`Hit` (with the producer's cost), or a :class:`Miss`: ``absent``, ``evicted`` (the
        record is there, a chunk of its blob is not), ``rejected`` (does not verify: never returned),
        or ``skipped`` (breaker open, or this lookup failed). Never raises."""
        if not self.breaker.allow():
            self.stats.add(self.name, kind, misses=1)
            return Miss(SKIPPED, self.name, "breaker open (the server failed recently)")
        start = time.perf_counter()
        try:
            record = self._read_pointer(self._pointer_key(kind, key))
            if record is None:
                self.stats.add(self.name, kind, misses=1, read_s=time.perf_counter() - start)
                return Miss(ABSENT, self.name)
            pointer, blob = self.keys.verify(record, namespace=self.namespace, kind=kind, key=key)
            if pointer.chunks:
                blob = self._read_blob(pointer)
                if blob is None:  # blob evicted before its pointer
                    self.stats.add(self.name, kind, misses=1, read_s=time.perf_counter() - start)
                    return Miss(EVICTED, self.name, f"{pointer.chunks} chunk(s) of a {pointer.size}-byte blob")
            value = self._zd.decompress(blob) if pointer.compressed else blob
        except IntegrityError as exc:
            self.stats.add(self.name, kind, rejected=1, misses=1)
            if not self._rejected_logged:
                log.warning("warmstart: rejected a remote %s entry: %s (treated as a miss)", kind, exc)
                self._rejected_logged = True
            return Miss(REJECTED, self.name, str(exc))
        except Exception as exc:
            self._failed(kind, exc)
            # Time lost waiting on a failing server is part of what the cache cost the job.
            self.stats.add(self.name, kind, read_s=time.perf_counter() - start)
            return Miss(SKIPPED, self.name, f"{type(exc).__name__}: {exc}")
        elapsed = time.perf_counter() - start
        self.stats.add(
            self.name, kind, hits=1, bytes_read=len(blob), read_s=elapsed, saved_s=max(0.0, pointer.cost_s - elapsed)
        )
        return Hit(value, self.name, pointer.cost_s)

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0) -> bool:
        # A verify-only key cannot sign, whatever the URL's credentials allow.
        if not self.keys.can_sign or self._write_refused or not self.breaker.allow():
            self.stats.add(self.name, kind, dropped=1)
            return False
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
        try:
            with _deadline(self.op_deadline_s + len(blob) / self.min_bytes_per_s):
                # One round trip: the blob's chunks, then the pointer. A reader that finds the pointer
                # before the chunks (another Cluster node) sees a miss, never a wrong value.
                pipe = self._client.pipeline(transaction=False)
                view = memoryview(blob)  # chunks without copies
                chunks = [view[i * self._chunk_bytes : (i + 1) * self._chunk_bytes] for i in range(len(chunk_keys))]
                for ckey, chunk in zip(chunk_keys, chunks, strict=True):
                    pipe.set(ckey, chunk, nx=True, ex=self._ttl_s)
                pipe.set(pkey, record, nx=kind not in REPLACED_KINDS, ex=self._ttl_s)
                pipe.sadd(self._index_key, pkey, *chunk_keys)  # what `cache clear` deletes, without SCAN
                results = pipe.execute()[:-1]
                existing = [(k, c) for k, c, done in zip(chunk_keys, chunks, results, strict=True) if not done]
                if existing:
                    self._check_chunks(existing)
                if not results[-1]:
                    self._repair_pointer(pkey, record, kind, key, pointer)
        except Exception as exc:
            self._failed(kind, exc, writing=True)
            return False
        self.stats.add(self.name, kind, writes=1, bytes_written=len(blob))
        if not self._registered:
            self.register()
        return True

    def _read_pointer(self, pkey: str) -> bytes | None:
        """A pointer record, or ``None`` when there is none. Never more than a pointer can be: one
        GETRANGE of at most the inline size plus the header, so a planted oversize value costs its
        first bytes, not its length.

        Raises:
            IntegrityError: the value under the pointer's name is larger than any pointer record.
        """
        cap = self._inline_bytes + _POINTER_HEADER_MAX
        record = self._client.getrange(pkey, 0, cap)
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
        _extend_deadline(pointer.size / self.min_bytes_per_s)
        # The writer's chunk size is not signed, but the size and count bound it: all chunks but the
        # last have one length L, with (n - 1) * L < size <= n * L.
        cap = pointer.size if n == 1 else -(-pointer.size // (n - 1)) - 1
        if cap < 1:  # GETRANGE 0 -1 would fetch everything
            raise IntegrityError(f"signed pointer names {n} chunks for a {pointer.size}-byte blob")
        pipe = self._client.pipeline(transaction=False)
        for ckey in self._chunk_keys(pointer.digest, n):
            pipe.strlen(ckey)
            pipe.getrange(ckey, 0, cap - 1)
        replies = pipe.execute()
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
        _extend_deadline(sum(len(c) for _, c in existing) / self.min_bytes_per_s)
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
        if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
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
        if isinstance(exc, _UNREACHABLE):
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

    # -- operations --------------------------------------------------------------------------
    @_bounded
    def ping(self) -> None:
        """Raise unless the server answers (within the operation deadline)."""
        self._client.ping()

    @_bounded
    def register(self) -> bool:
        """Record this namespace and key id, with the namespace's components, in the server's
        registry (:data:`REGISTRY_KEY`); done once per process, after its first write. Never raises:
        a server whose ACL predates the registry just goes without it."""
        self._registered = True
        if self.components is None:
            return False
        entry = {
            "namespace": self.namespace,
            "key_id": self.key_id,
            "scheme": self.keys.scheme,
            "components": dict(self.components),
            "ts": round(time.time(), 3),
        }
        try:
            self._client.hset(REGISTRY_KEY, f"{self.namespace}/{self.key_id}", json.dumps(entry, sort_keys=True))
            return True
        except Exception as exc:
            log.debug("warmstart: could not register namespace %s on the server: %s", self.namespace, exc)
            return False

    @_bounded
    def registry(self) -> list[dict[str, object]]:
        """The namespaces and key ids registered on the server (see :meth:`register`), each a dict
        with ``namespace``, ``key_id``, ``scheme``, ``components`` and ``ts``. Written by anyone with
        writer credentials: for explaining misses, never for trusting an entry.

        Raises:
            redis.RedisError: the server cannot be asked.
        """
        if self._client.hlen(REGISTRY_KEY) > _REGISTRY_MAX_FIELDS:
            return []
        entries = []
        for raw in self._client.hgetall(REGISTRY_KEY).values():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("components"), dict):
                entries.append(entry)
        return entries

    def holders(self, entries: list[tuple[str, str]], pairs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
        """For each ``(kind, key)`` of ``entries``, which of ``pairs`` (namespace, key id) hold a
        record for it: an entry a job missed may exist for another namespace or under another key.
        One pipelined round trip of ``EXISTS`` per thousand questions, each under the operation deadline.

        Raises:
            redis.RedisError: the server cannot be asked.
        """
        questions = [f"{KEY_PREFIX}{ns}:p:{kind}:{key_id}:{key}" for kind, key in entries for ns, key_id in pairs]
        answers: list[int] = []
        for start in range(0, len(questions), 1000):
            pipe = self._client.pipeline(transaction=False)
            for name in questions[start : start + 1000]:
                pipe.exists(name)
            with _deadline(self.op_deadline_s):
                answers += pipe.execute()
        n = len(pairs)
        return [
            [pair for pair, found in zip(pairs, answers[i * n : (i + 1) * n], strict=True) if found]
            for i in range(len(entries))
        ]

    # -- leases (see single_flight.py) ----------------------------------------------------------
    def _lease_key(self, kind: str, key: str) -> str:
        return f"{self._prefix}l:{kind}:{self.key_id}:{key}"

    @_bounded
    def take_lease(self, kind: str, key: str, token: str, ttl_s: float) -> bool | None:
        """Take the lease on an entry (``SET NX PX`` of a signed lease record): True when taken, False
        when another process holds a lease this job trusts, None when leases cannot be used now
        (breaker open, the server failed, credentials that may not write, or a record under the
        lease's name that is no lease this job trusts: it is ignored, and this job compiles). Never
        raises."""
        if self._write_refused or not self.keys.can_sign or not self.breaker.allow():
            return None
        ttl_ms = max(1, int(ttl_s * 1000))
        name = self._lease_key(kind, key)
        try:
            record = self.keys.sign_lease(signing.LeaseRecord(self.namespace, kind, key, token, _now_ms() + ttl_ms))
            if self._client.set(name, record, nx=True, px=ttl_ms):
                return True
            return False if self._trusted_lease(self._client.get(name), kind, key) is not None else None
        except Exception as exc:
            return self._lease_failed(exc)

    @_bounded
    def lease_held(self, kind: str, key: str) -> bool | None:
        """Whether some process holds a lease on an entry that this job trusts (signed by its key,
        for this entry, not expired); None when the server cannot say."""
        if not self.breaker.allow():
            return None
        try:
            return self._trusted_lease(self._client.get(self._lease_key(kind, key)), kind, key) is not None
        except Exception as exc:
            return self._lease_failed(exc)

    @_bounded
    def renew_leases(self, leases: list[tuple[str, str, str]], ttl_s: float) -> list[tuple[str, str]]:
        """Extend each lease of ``(kind, key, token)`` that is still this process's by ``ttl_s``, and
        return the ``(kind, key)`` of those it no longer holds.

        Each renewal is a compare-and-set (WATCH, GET, then MULTI/SET XX PX/EXEC): it never extends or
        takes a lease another process took after this one's lapsed, even by a moment."""
        if not self.breaker.allow():
            return []
        ttl_ms = max(1, int(ttl_s * 1000))
        lost = []
        try:
            for kind, key, token in leases:
                record = self.keys.sign_lease(signing.LeaseRecord(self.namespace, kind, key, token, _now_ms() + ttl_ms))
                if not self._compare_and_set(
                    kind, key, token, lambda pipe, name, record=record: pipe.set(name, record, xx=True, px=ttl_ms)
                ):
                    lost.append((kind, key))
        except Exception as exc:
            self._lease_failed(exc)
        return lost

    @_bounded
    def drop_lease(self, kind: str, key: str, token: str) -> None:
        """Release a lease if it is still this process's (compare-and-delete, as renewals)."""
        if not self.breaker.allow():
            return
        try:
            self._compare_and_set(kind, key, token, lambda pipe, name: pipe.delete(name))
        except Exception as exc:
            self._lease_failed(exc)

    def _compare_and_set(self, kind: str, key: str, token: str, write) -> bool:
        """Run ``write(pipe, name)`` on the lease's key in a transaction, only if the key holds this
        process's lease (``token``) from the WATCH to the EXEC; whether it ran."""
        name = self._lease_key(kind, key)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(name)
            lease = self._trusted_lease(pipe.get(name), kind, key)
            if lease is None or lease.token != token:
                pipe.unwatch()
                return False
            pipe.multi()
            write(pipe, name)
            try:
                pipe.execute()
            except redis.exceptions.WatchError:  # changed between GET and EXEC: someone else's now
                return False
        return True

    def _trusted_lease(self, record: bytes | None, kind: str, key: str) -> signing.LeaseRecord | None:
        """The lease ``record`` holds if this job trusts it: signed by its key, for this entry, and
        neither expired nor claiming more than ``LEASE_MAX_S`` ahead; ``None`` otherwise (anything
        else under a lease's name is ignored, once counted and warned about)."""
        if record is None:
            return None
        try:
            lease = self.keys.verify_lease(record, namespace=self.namespace, kind=kind, key=key)
        except IntegrityError as exc:
            self.stats.bump("leases_ignored")
            warn_once(
                "lease-untrusted",
                "warmstart: ignoring a lease record that this job's key does not verify (%s): "
                "compiling instead of waiting for it",
                exc,
            )
            return None
        now = _now_ms()
        if not now < lease.expires_ms <= now + int(_defaults.LEASE_MAX_S * 1000):
            return None
        return lease

    def _lease_failed(self, exc: Exception) -> None:
        if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
            self._write_refused = True  # reader credentials: this job waits on leases, never takes one
            return None
        if isinstance(exc, _UNREACHABLE):
            self.breaker.trip(f"{type(exc).__name__}: {exc}")
        else:
            log.debug("warmstart: lease operation failed: %s", exc)
        return None

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

    def _unregister(self) -> None:
        # This namespace's fields of the registry (one per key id that wrote to it).
        if self._client.hlen(REGISTRY_KEY) > _REGISTRY_MAX_FIELDS:
            return
        mine = f"{self.namespace}/".encode()
        fields = [
            f for f in self._client.hkeys(REGISTRY_KEY) if (f if isinstance(f, bytes) else f.encode()).startswith(mine)
        ]
        if fields:
            self._client.hdel(REGISTRY_KEY, *fields)

    def _delete(self, keys: list) -> int:
        if isinstance(self._client, redis.Redis):
            return int(self._client.unlink(*keys))
        return sum(int(self._client.unlink(k)) for k in keys)  # cluster: keys span slots

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass


def _now_ms() -> int:
    return int(time.time() * 1000)
