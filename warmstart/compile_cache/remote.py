"""The remote tier: Redis (one node, TLS, or a Redis Cluster) behind signed, content-addressed entries.

Layout under the key prefix ``ws:<namespace>:``:

* ``p:<kind>:<key id>:<key>``: a pointer record signed with the job's secret (see ``signing.py``;
  the key id names the secret, so jobs with different secrets never touch each other's records).
  Values of up to 64 KiB (compressed) live inside it: one round trip to read, one to write;
* ``b:{<blake3>}:<i>``: chunk ``i`` of a larger zstd-compressed blob, split under Redis value limits.
  The digest is a hash tag, so all chunks of a blob live in one Cluster slot and come back in one MGET.

Identical large artifacts under different keys are stored once. Writes are ``SET NX``: the first
writer wins when processes race. Timeouts are short, and the first connection failure opens a circuit
breaker, so a slow or dead server costs a job at most one timeout.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import parse_qs, unquote, urlencode, urlsplit, urlunsplit

import redis
import zstandard
from redis.backoff import NoBackoff
from redis.retry import Retry

from warmstart import _defaults
from warmstart.compile_cache import signing
from warmstart.compile_cache.breaker import CircuitBreaker
from warmstart.compile_cache.stats import Stats
from warmstart.config import compression_level, validate_cache_url
from warmstart.errors import IntegrityError

log = logging.getLogger("warmstart.cache")

KEY_PREFIX = "ws:"
_COMPRESS_MIN = 1024
_PROBE_BYTES = 64 * 1024  # compress this much first; skip compressing what does not shrink
_PROBE_ABOVE = 1024 * 1024  # below this, compressing everything costs less than probing first
_URL_OPTIONS = {"ssl_ca_certs": str, "ssl_certfile": str, "ssl_keyfile": str, "ssl_cert_reqs": str,
                "ssl_check_hostname": lambda v: v.lower() in ("1", "true", "yes"),
                "socket_timeout": float, "socket_connect_timeout": float}


def connect(url: str, *, connect_timeout: float = _defaults.REMOTE_CONNECT_TIMEOUT_S,
            socket_timeout: float = _defaults.REMOTE_SOCKET_TIMEOUT_S) -> redis.Redis | redis.RedisCluster:
    """A redis-py client for a warmstart URL, with short timeouts and no retries (the breaker decides).

    Cluster clients connect lazily on first use, like single-node ones.
    """
    validate_cache_url(url)
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if "compress" in query:  # warmstart's own option: redis-py must not see it
        query.pop("compress")
        parts = parts._replace(query=urlencode(query, doseq=True))
        url = urlunsplit(parts)
    options = {name: _URL_OPTIONS[name](values[-1]) for name, values in query.items() if name in _URL_OPTIONS}
    common = dict(socket_connect_timeout=options.pop("socket_connect_timeout", connect_timeout),
                  socket_timeout=options.pop("socket_timeout", socket_timeout))
    if not parts.scheme.endswith("+cluster"):
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), health_check_interval=0, **common)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes = []
    for hostport in hosts.split(","):
        host, _, port = hostport.rpartition(":")
        nodes.append(redis.cluster.ClusterNode(host, int(port)))
    return _LazyCluster(
        startup_nodes=nodes, username=unquote(username) or None, password=unquote(password) or None,
        ssl=parts.scheme.startswith("rediss"), retry=Retry(NoBackoff(), 0),
        cluster_error_retry_attempts=0, **common, **options,
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
                self._client = redis.RedisCluster(**self._kwargs)
        return getattr(self._client, name)


class RemoteTier:
    """Signed, content-addressed artifacts in Redis.

    Args:
        url: ``redis://``, ``rediss://`` or ``redis+cluster://`` URL (credentials in the URL). Query
            options: redis-py's TLS and timeout options, and ``compress=`` (a zstd level, default
            -3, or ``off``) for the values this process writes; readers handle either.
        secret: HMAC key; entries that do not verify under it are never returned.
        namespace: compatibility namespace (see ``namespace.py``); keys never cross namespaces.
        stats: where to count; a private ``Stats`` when omitted.
    """

    name = "remote"

    def __init__(self, url: str, *, secret: bytes, namespace: str, stats: Stats | None = None,
                 ttl_s: int = _defaults.REMOTE_TTL_S, chunk_bytes: int = _defaults.CHUNK_BYTES,
                 inline_bytes: int = _defaults.INLINE_BYTES) -> None:
        if not secret:
            raise ValueError("RemoteTier needs a non-empty secret")
        self.url = url
        self.namespace = namespace
        self.stats = stats or Stats()
        self._secret = secret
        self._ttl_s = ttl_s
        self._chunk_bytes = chunk_bytes
        self._inline_bytes = inline_bytes
        self._client = connect(url)
        self._prefix = f"{KEY_PREFIX}{namespace}:"
        self.key_id = signing.key_id(secret)
        self._read_only = False
        self._rejected_logged = False
        self._error_logged = False
        self.breaker = CircuitBreaker(self.ping, name="remote")
        compress = parse_qs(urlsplit(url).query).get("compress")
        level = compression_level(compress[-1]) if compress else _defaults.COMPRESS_LEVEL
        self._zc = zstandard.ZstdCompressor(level=level) if level is not None else None
        self._zd = zstandard.ZstdDecompressor()

    # -- keys --------------------------------------------------------------------------------
    def _pointer_key(self, kind: str, key: str) -> str:
        return f"{self._prefix}p:{kind}:{self.key_id}:{key}"

    def _chunk_keys(self, digest: str, chunks: int) -> list[str]:
        return [f"{self._prefix}b:{{{digest}}}:{i}" for i in range(chunks)]

    # -- Storage -----------------------------------------------------------------------------
    def get(self, kind: str, key: str) -> bytes | None:
        found = self.fetch(kind, key)
        return found[0] if found else None

    def fetch(self, kind: str, key: str) -> tuple[bytes, float] | None:
        """Like :meth:`get`, also returning the producer's cost in seconds."""
        if not self.breaker.allow():
            self.stats.add(self.name, kind, misses=1)
            return None
        start = time.perf_counter()
        try:
            record = self._client.get(self._pointer_key(kind, key))
            if record is None:
                self.stats.add(self.name, kind, misses=1, read_s=time.perf_counter() - start)
                return None
            pointer, blob = signing.verify(self._secret, record, namespace=self.namespace, kind=kind, key=key)
            if pointer.chunks:
                parts = self._client.mget(self._chunk_keys(pointer.digest, pointer.chunks))
                if any(p is None for p in parts):  # blob evicted before its pointer
                    self.stats.add(self.name, kind, misses=1, read_s=time.perf_counter() - start)
                    return None
                blob = parts[0] if len(parts) == 1 else b"".join(parts)
                signing.check_blob(pointer, blob)
            value = self._zd.decompress(blob) if pointer.compressed else blob
        except IntegrityError as exc:
            self.stats.add(self.name, kind, rejected=1, misses=1)
            if not self._rejected_logged:
                log.warning("warmstart: rejected a remote %s entry: %s (treated as a miss)", kind, exc)
                self._rejected_logged = True
            return None
        except Exception as exc:
            self._failed(kind, exc)
            # Time lost waiting on a failing server is part of what the cache cost the job.
            self.stats.add(self.name, kind, read_s=time.perf_counter() - start)
            return None
        elapsed = time.perf_counter() - start
        self.stats.add(self.name, kind, hits=1, bytes_read=len(blob), read_s=elapsed,
                       saved_s=max(0.0, pointer.cost_s - elapsed))
        return value, pointer.cost_s

    def put(self, kind: str, key: str, value: bytes, *, cost_s: float = 0.0) -> bool:
        if self._read_only or not self.breaker.allow():
            self.stats.add(self.name, kind, dropped=1)
            return False
        blob, compressed = self._compress(value)
        pkey = self._pointer_key(kind, key)
        if len(blob) <= self._inline_bytes:
            pointer = signing.Pointer(self.namespace, kind, key, "", len(blob), 0, compressed, cost_s)
            record, chunk_keys = signing.sign(self._secret, pointer, blob), []
        else:
            digest = signing.blob_digest(blob)
            chunk_keys = self._chunk_keys(digest, -(-len(blob) // self._chunk_bytes))
            pointer = signing.Pointer(self.namespace, kind, key, digest, len(blob), len(chunk_keys), compressed, cost_s)
            record = signing.sign(self._secret, pointer)
        try:
            # One round trip: the blob's chunks, then the pointer. A reader that finds the pointer
            # before the chunks (another Cluster node) sees a miss, never a wrong value.
            pipe = self._client.pipeline(transaction=False)
            view = memoryview(blob)  # chunks without copies
            for i, ckey in enumerate(chunk_keys):
                pipe.set(ckey, view[i * self._chunk_bytes:(i + 1) * self._chunk_bytes], nx=True, ex=self._ttl_s)
            pipe.set(pkey, record, nx=True, ex=self._ttl_s)
            if not pipe.execute()[-1]:
                self._repair_pointer(pkey, record, kind, key)
        except Exception as exc:
            self._failed(kind, exc, writing=True)
            return False
        self.stats.add(self.name, kind, writes=1, bytes_written=len(blob))
        return True

    def _compress(self, value: bytes) -> tuple[bytes, bool]:
        if self._zc is None or len(value) < _COMPRESS_MIN:
            return value, False
        if len(value) > _PROBE_ABOVE:  # machine code that is already packed: do not pay for nothing
            probe = self._zc.compress(value[:_PROBE_BYTES])
            if len(probe) > 0.9 * _PROBE_BYTES:
                return value, False
        blob = self._zc.compress(value)
        return (blob, True) if len(blob) < len(value) else (value, False)

    def _repair_pointer(self, pkey: str, record: bytes, kind: str, key: str) -> None:
        # First writer wins, unless the existing pointer is unusable (its blob was evicted, or it
        # does not verify: the key id in its name is our secret's, so it was damaged or tampered
        # with): then ours replaces it.
        existing = self._client.get(pkey)
        try:
            old, _ = signing.verify(self._secret, existing or b"", namespace=self.namespace, kind=kind, key=key)
            if old.chunks == 0 or self._client.exists(self._chunk_keys(old.digest, old.chunks)[-1]):
                return
        except IntegrityError:
            pass
        self._client.set(pkey, record, ex=self._ttl_s)

    def _failed(self, kind: str, exc: Exception, writing: bool = False) -> None:
        if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
            if writing:  # read-only credentials: stop trying to write, keep reading
                self._read_only = True
                self.stats.add(self.name, kind, dropped=1)
                log.warning("warmstart: remote cache credentials are read-only; not writing to it")
            else:
                self.stats.add(self.name, kind, errors=1, misses=1)
            return
        if isinstance(exc, redis.exceptions.TimeoutError):
            self.stats.add(self.name, kind, timeouts=1, **({} if writing else {"misses": 1}))
        else:
            self.stats.add(self.name, kind, errors=1, **({} if writing else {"misses": 1}))
        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                            redis.exceptions.AuthenticationError)):
            self.breaker.trip(f"{type(exc).__name__}: {exc}")
        elif not self._error_logged:  # not the server's state: worth one line, never a failure
            self._error_logged = True
            log.warning("warmstart: remote %s %s failed (%s: %s); treated as a miss", kind,
                        "write" if writing else "read", type(exc).__name__, exc)

    # -- operations --------------------------------------------------------------------------
    def ping(self) -> None:
        """Raise unless the server answers."""
        self._client.ping()

    def delete(self, kind: str, key: str) -> bool:
        """Remove one entry's pointer (its blob, shared by content, is left to LRU eviction)."""
        return bool(self._client.unlink(self._pointer_key(kind, key)))

    def key_ids(self, limit: int = 10_000) -> dict[str, int]:
        """Pointer records of this namespace per signing key id, over at most ``limit`` keys.

        Entries under another key id were written by jobs holding another secret; this job never
        reads them (``warmstart cache doctor`` reports them).
        """
        counts: dict[str, int] = {}
        pattern = f"{self._prefix}p:*"
        for n, name in enumerate(self._client.scan_iter(match=pattern, count=1000)):
            if n >= limit:
                break
            parts = (name.decode() if isinstance(name, bytes) else name)[len(self._prefix):].split(":", 3)
            if len(parts) == 4:
                counts[parts[2]] = counts.get(parts[2], 0) + 1
        return counts

    def clear(self) -> int:
        """Delete every key of this namespace; returns how many were deleted."""
        deleted = 0
        batch: list[str] = []
        for key in self._client.scan_iter(match=f"{self._prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += self._delete(batch)
                batch = []
        if batch:
            deleted += self._delete(batch)
        return deleted

    def _delete(self, keys: list) -> int:
        if isinstance(self._client, redis.Redis):
            return int(self._client.unlink(*keys))
        return sum(int(self._client.unlink(k)) for k in keys)  # cluster: keys span slots

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass
