"""Leases on the remote tier: which process is compiling an entry now (see ``single_flight.py``).

A lease is ``<prefix>l:<kind>:<key id>:<key>``: a signed lease record with a random token, set with
``SET NX PX`` and expiring unless its holder renews it. Renewals and releases are compare-and-set
transactions (WATCH, GET, then MULTI/EXEC), so a holder that stalled past its lease's lapse never
extends or removes the lease another process took since. Only records this job's key verifies, for
this entry and not expired, are honoured: anything else under a lease's name is ignored.

:class:`Leases` is an object over the tier's
:class:`~warmstart.compile_cache.remote_client.RemoteConnection` (``RemoteTier.leases``), as
redis-py's ``Lock`` holds a client: leases share the tier's client, keys, deadline and breaker, and
whoever takes them (single-flight) holds this object, not the tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from warmstart import _defaults
from warmstart.compile_cache import signing
from warmstart.compile_cache.remote_client import UNREACHABLE, Client, RemoteConnection, as_bytes, bounded
from warmstart.compile_cache.storage import warn_once
from warmstart.errors import IntegrityError

log = logging.getLogger("warmstart.cache")


class Leases:
    """Take, check, renew and drop leases on entries of ``connection``'s namespace, under its keys."""

    def __init__(self, connection: RemoteConnection) -> None:
        self.connection = connection

    @property
    def _client(self) -> Client:
        return self.connection._client

    @property
    def op_deadline_s(self) -> float:
        """The connection's deadline per operation: a lease operation is one."""
        return self.connection.op_deadline_s

    def _took(self, elapsed_s: float, allowance_s: float) -> None:
        # A slow lease operation is as much a sign of a slow server as a slow lookup.
        self.connection._took(elapsed_s, allowance_s)

    def _lease_key(self, kind: str, key: str) -> str:
        return f"{self.connection._prefix}l:{kind}:{self.connection.key_id}:{key}"

    @bounded
    def take(self, kind: str, key: str, token: str, ttl_s: float) -> bool | None:
        """Take the lease on an entry (``SET NX PX`` of a signed lease record): True when taken, False
        when another process holds a lease this job trusts, None when leases cannot be used now
        (breaker open, the server failed, credentials that may not write, or a record under the
        lease's name that is no lease this job trusts: it is ignored, and this job compiles). Never
        raises."""
        conn = self.connection
        if conn._write_refused or not conn.keys.can_sign or not conn._available():
            return None
        ttl_ms = max(1, int(ttl_s * 1000))
        name = self._lease_key(kind, key)
        try:
            record = conn.keys.sign_lease(signing.LeaseRecord(conn.namespace, kind, key, token, _now_ms() + ttl_ms))
            if self._client.set(name, record, nx=True, px=ttl_ms):
                return True
            return False if self._trusted_lease(as_bytes(self._client.get(name)), kind, key) is not None else None
        except Exception as exc:
            self._lease_failed(exc)
            return None

    @bounded
    def held(self, kind: str, key: str) -> bool | None:
        """Whether some process holds a lease on an entry that this job trusts (signed by its key,
        for this entry, not expired); None when the server cannot say."""
        if not self.connection._available():
            return None
        try:
            return self._trusted_lease(as_bytes(self._client.get(self._lease_key(kind, key))), kind, key) is not None
        except Exception as exc:
            self._lease_failed(exc)
            return None

    @bounded
    def renew(self, leases: list[tuple[str, str, str]], ttl_s: float) -> list[tuple[str, str]]:
        """Extend each lease of ``(kind, key, token)`` that is still this process's by ``ttl_s``, and
        return the ``(kind, key)`` of those it no longer holds.

        Each renewal is a compare-and-set (WATCH, GET, then MULTI/SET XX PX/EXEC): it never extends or
        takes a lease another process took after this one's lapsed, even by a moment."""
        conn = self.connection
        if not conn._available():
            return []
        ttl_ms = max(1, int(ttl_s * 1000))
        lost = []
        try:
            for kind, key, token in leases:
                record = conn.keys.sign_lease(signing.LeaseRecord(conn.namespace, kind, key, token, _now_ms() + ttl_ms))

                def extend(pipe: Any, name: str, record: bytes = record) -> None:
                    pipe.set(name, record, xx=True, px=ttl_ms)

                if not self._compare_and_set(kind, key, token, extend):
                    lost.append((kind, key))
        except Exception as exc:
            self._lease_failed(exc)
        return lost

    @bounded
    def drop(self, kind: str, key: str, token: str) -> None:
        """Release a lease if it is still this process's (compare-and-delete, as renewals)."""
        if not self.connection._available():
            return
        try:
            self._compare_and_set(kind, key, token, lambda pipe, name: pipe.delete(name))
        except Exception as exc:
            self._lease_failed(exc)

    def _compare_and_set(self, kind: str, key: str, token: str, write: Callable[[Any, str], object]) -> bool:
        """Run ``write(pipe, name)`` on the lease's key in a transaction, only if the key holds this
        process's lease (``token``) from the WATCH to the EXEC; whether it ran."""
        name = self._lease_key(kind, key)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(name)
            lease = self._trusted_lease(as_bytes(pipe.get(name)), kind, key)
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
        conn = self.connection
        try:
            lease = conn.keys.verify_lease(record, namespace=conn.namespace, kind=kind, key=key)
        except IntegrityError as exc:
            conn.stats.bump("leases_ignored")
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
        conn = self.connection
        if conn._no_permission(exc):
            conn._write_refused = True  # reader credentials: this job waits on leases, never takes one
            return
        if isinstance(exc, UNREACHABLE):
            conn.breaker.trip(f"{type(exc).__name__}: {exc}")
        else:
            log.debug("warmstart: lease operation failed: %s", exc)


def _now_ms() -> int:
    return int(time.time() * 1000)
