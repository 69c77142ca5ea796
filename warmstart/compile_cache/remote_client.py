"""The remote tier's connection: a redis-py client whose every operation has a deadline, and the
circuit breaker that keeps a failing or slow server off the job's path.

redis-py's ``socket_timeout`` bounds each socket read: a server that sends one byte just before each
read would time out stalls a call for as long as it likes. Every remote operation therefore sets a
deadline for this thread (:func:`deadline`, :func:`bounded`), and the client's sockets (wrapped as
they connect) time out at it. The first failure (a timeout, a refused connection, an unreachable
cluster), or ``REMOTE_SLOW_IN_A_ROW`` operations in a row that took most of their deadline, open
the breaker, so a slow, stalled or dead server costs a job at most one deadline.

:class:`RemoteConnection` is the base of :class:`~warmstart.compile_cache.remote.RemoteTier`, and its
namespace registry (``remote_registry.py``) a mixin over it; its leases (``remote_leases.py``) are an
object that holds it.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from warmstart import _defaults
from warmstart.compile_cache import signing
from warmstart.compile_cache.breaker import CircuitBreaker
from warmstart.compile_cache.keyspace import KEY_PREFIX
from warmstart.compile_cache.stats import Stats
from warmstart.config import url_options, validate_cache_url

#: Failures that say the server (or cluster) cannot serve now: they open the circuit breaker.
UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
    redis.exceptions.RedisClusterException,  # "cannot be connected", SlotNotCoveredError
    redis.exceptions.ClusterError,
)  # ClusterDownError, MasterDownError

#: The counters of round trips to the server: made by the job's own threads (each one on the path of
#: a lookup), and by the thread that fetches entries ahead (``fetch_ahead.py``).
TRIPS = "round_trips"
TRIPS_AHEAD = "round_trips_ahead"

# .deadline: time.monotonic() by which this thread's remote operation ends; .ahead: this thread
# fetches ahead (its round trips are counted apart)
_op = threading.local()


def fetching_ahead() -> None:
    """Count this thread's round trips as the fetch ahead's, not the job's."""
    _op.ahead = True


_T = TypeVar("_T")
_P = ParamSpec("_P")
_C = TypeVar("_C", bound="_Bounded")


class _Bounded(Protocol):
    """What :func:`bounded` needs of the object whose method it bounds: a connection, or a part of
    one (its leases) that reports to it."""

    @property
    def op_deadline_s(self) -> float: ...

    def _took(self, elapsed_s: float, allowance_s: float) -> None: ...


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Bound this thread's remote calls in the block to ``seconds`` in all (an enclosing, earlier
    deadline still holds)."""
    outer = getattr(_op, "deadline", None)
    end = time.monotonic() + seconds
    _op.deadline = end if outer is None else min(outer, end)
    try:
        yield
    finally:
        _op.deadline = outer


def extend_deadline(seconds: float) -> None:
    """Give the current operation ``seconds`` more: for moving a value once its size is known."""
    if getattr(_op, "deadline", None) is not None:
        _op.deadline += seconds


def bounded(method: Callable[Concatenate[_C, _P], _T]) -> Callable[Concatenate[_C, _P], _T]:
    """Run a :class:`RemoteConnection` method (or a method of its leases) under its operation
    deadline, and tell the connection how much of its deadline it took (slow is a fault too: see
    :meth:`RemoteConnection._took`)."""

    @functools.wraps(method)
    def run_bounded(self: _C, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        start = time.monotonic()
        outer = getattr(_op, "deadline", None)
        allowance = self.op_deadline_s
        try:
            with deadline(self.op_deadline_s):
                try:
                    return method(self, *args, **kwargs)
                finally:
                    allowance = _op.deadline - start  # with what the value's size added
        finally:
            if outer is None:  # the outermost operation of this thread
                self._took(time.monotonic() - start, allowance)

    return run_bounded


class _DeadlineSocket:
    """A connected socket whose reads and writes time out at the calling thread's deadline (and,
    as before, after the connection's own timeout per call). Past it, redis-py sees an ordinary
    socket timeout: it drops the connection and raises ``TimeoutError``; no thread is left waiting."""

    __slots__ = ("_on_trip", "_sent", "_sock", "_timeout")

    def __init__(self, sock: socket.socket, on_trip: Callable[[], None] | None = None) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()
        self._on_trip = on_trip
        self._sent = False  # a read after a write waits for the server: one round trip

    def _replied(self) -> None:
        if self._sent:
            self._sent = False
            if self._on_trip is not None:
                self._on_trip()

    def _arm(self) -> None:
        end = getattr(_op, "deadline", None)
        if end is None:
            self._sock.settimeout(self._timeout)
            return
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("warmstart: remote operation deadline passed")
        self._sock.settimeout(remaining if self._timeout is None else min(self._timeout, remaining))

    def recv(self, *args: Any) -> bytes:
        self._arm()
        self._replied()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._arm()
        self._replied()
        return self._sock.recv_into(*args)

    def send(self, *args: Any) -> int:
        self._arm()
        self._sent = True
        return self._sock.send(*args)

    def sendall(self, *args: Any) -> None:
        self._arm()  # since Python 3.5 a timeout bounds the whole sendall
        self._sent = True
        self._sock.sendall(*args)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def setblocking(self, flag: bool) -> None:
        self.settimeout(None if flag else 0.0)

    def __getattr__(self, name: str) -> Any:  # fileno, close, shutdown, ... of the real socket
        return getattr(self._sock, name)


def _bound_socket(connection: Any, on_trip: Callable[[], None] | None) -> None:
    # Before the handshake (AUTH, HELLO), so that is bounded too. redis-py has no socket factory
    # hook: the connected socket is swapped in place, and its parser binds to it in on_connect().
    if not isinstance(connection._sock, _DeadlineSocket):
        connection._sock = _DeadlineSocket(connection._sock, on_trip)
        if on_trip is not None:
            on_trip()  # the TCP handshake that made it


def _connect_func(on_trip: Callable[[], None] | None) -> Callable[[Any], None]:
    def on_connect(connection: Any) -> None:
        _bound_socket(connection, on_trip)
        connection.on_connect()

    return on_connect


class _Cluster(redis.RedisCluster):
    """RedisCluster whose node connections are deadline-bound (it runs ``on_connect`` for each)."""

    def __init__(self, *, on_trip: Callable[[], None] | None = None, **kwargs: Any) -> None:
        self._on_trip = on_trip
        super().__init__(**kwargs)

    def on_connect(self, connection: Any) -> None:
        _bound_socket(connection, self._on_trip)
        super().on_connect(connection)


class _LazyCluster:
    """RedisCluster connects in its constructor; this defers that to the first command, so that
    building a store never blocks and a dead cluster fails inside the breaker's guard."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._client: redis.RedisCluster | None = None

    def __getattr__(self, name: str) -> Any:  # every RedisCluster method, once connected
        if self._client is None:
            with warnings.catch_warnings():  # cluster_error_retry_attempts is deprecated but still honoured
                warnings.simplefilter("ignore")
                self._client = _Cluster(**self._kwargs)
        return getattr(self._client, name)


Client = redis.Redis | _LazyCluster
"""What :func:`connect` makes: a single-node client, or a Cluster client that connects on first use."""


def connect(
    url: str,
    *,
    connect_timeout: float = _defaults.REMOTE_CONNECT_TIMEOUT_S,
    socket_timeout: float = _defaults.REMOTE_SOCKET_TIMEOUT_S,
    on_trip: Callable[[], None] | None = None,
) -> Client:
    """A redis-py client for a warmstart URL, with short timeouts and no retries (the breaker decides).

    Cluster clients connect lazily on first use, like single-node ones. ``on_trip`` is called for
    each round trip to the server (a connection made, a reply waited for after a request).
    """
    validate_cache_url(url)
    options: dict[str, Any] = url_options(url)
    options.pop("compress", None)  # warmstart's own option: redis-py must not see it
    parts = urlsplit(url)
    url = urlunsplit(parts._replace(query=""))  # redis-py gets the options as arguments instead
    common = dict(
        socket_connect_timeout=options.pop("socket_connect_timeout", connect_timeout),
        socket_timeout=options.pop("socket_timeout", socket_timeout),
        socket_read_size=_defaults.REMOTE_SOCKET_READ_BYTES,
        # No CLIENT SETINFO after connecting: two round trips for a name only `CLIENT LIST` shows.
        driver_info=None,
    )
    if not parts.scheme.endswith("+cluster"):
        return redis.Redis.from_url(
            url,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            redis_connect_func=_connect_func(on_trip),
            # No CLIENT MAINT_NOTIFICATIONS handshake either: one more round trip per connection, for
            # managed-service maintenance moves warmstart's short operations need not follow.
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
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
        on_trip=on_trip,
        **common,
        **options,
    )


def as_bytes(reply: object) -> bytes | None:
    """A reply of GET or GETRANGE as bytes (the client never decodes replies); ``None`` for none."""
    if reply is None or isinstance(reply, bytes):
        return reply
    if isinstance(reply, str):
        return reply.encode()
    raise TypeError(f"unexpected reply type {type(reply).__name__}")


class RemoteConnection:
    """A namespace of one Redis server (or Cluster) under ``keys``, reached through :func:`connect`,
    with a deadline per operation and a circuit breaker.

    Its underscored members (the client, the key prefix, whether writes were refused) are shared
    with the parts of the remote tier that use this connection, its leases included; not with
    callers.

    Args:
        url: ``redis://``, ``rediss://`` or ``redis+cluster://`` URL (credentials in the URL).
        keys: what this connection's records are signed and verified with.
        namespace: compatibility namespace (see ``namespace.py``); keys never cross namespaces.
        stats: where to count; a private ``Stats`` when omitted.
    """

    op_deadline_s: float = _defaults.REMOTE_OP_DEADLINE_S
    """Seconds one operation may take, plus its value's size at ``min_bytes_per_s``."""
    min_bytes_per_s: float = _defaults.REMOTE_MIN_BYTES_PER_S

    def __init__(self, url: str, *, keys: signing.Keys, namespace: str, stats: Stats | None = None) -> None:
        self.url = url
        self.namespace = namespace
        self.keys = keys
        self.key_id = keys.key_id
        self.stats = stats or Stats()
        self._client: Client = connect(url, on_trip=self._trip)
        self._prefix = f"{KEY_PREFIX}{namespace}:"
        self._write_refused = False  # the server said NOPERM to a write: read-only credentials
        self.breaker = CircuitBreaker(self._probe, name="remote")
        self._slow_in_a_row = 0
        self.closed = False
        """Set by :meth:`close`."""

    def _trip(self) -> None:
        # Counted by the thread that waits for it: a job's own lookups, or the fetch ahead.
        self.stats.bump(TRIPS_AHEAD if getattr(_op, "ahead", False) else TRIPS)

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
        with deadline(self.op_deadline_s):
            self.ping()
        elapsed = time.monotonic() - start
        if elapsed > _defaults.REMOTE_SLOW_SHARE * self.op_deadline_s:
            raise TimeoutError(f"PING took {elapsed:.2f} s")

    @bounded
    def ping(self) -> None:
        """Raise unless the server answers (within the operation deadline)."""
        self._client.ping()

    def _available(self) -> bool:
        """Whether an operation may go to the server now: the tier is open and its breaker closed."""
        return not self.closed and self.breaker.allow()

    def close(self) -> None:
        """Close the client's connections: later operations miss or refuse. Idempotent, never raises."""
        self.closed = True
        with contextlib.suppress(Exception):
            self._client.close()

    @staticmethod
    def _no_permission(exc: Exception) -> bool:
        """The server refused the command to these credentials (a reader's URL writing)."""
        return isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc)
