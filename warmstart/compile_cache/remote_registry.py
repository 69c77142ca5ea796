"""The server's namespace registry (:data:`~warmstart.compile_cache.keyspace.REGISTRY_KEY`): which
namespaces and signing key ids wrote to it, with each namespace's components.

Every writing process registers once, after its first write; ``warmstart cache explain`` reads the
registry, and asks which of those namespaces and keys hold the entries a job missed, to name what
differs between machines without scanning keys. The registry is written by anyone with writer
credentials and is not signed: it explains misses, and is never used to trust an entry.

A mixin over :class:`~warmstart.compile_cache.remote_client.RemoteConnection`, called as methods
of the tier.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping

from warmstart.compile_cache.keyspace import KEY_PREFIX, REGISTRY_KEY
from warmstart.compile_cache.remote_client import RemoteConnection, bounded, deadline

log = logging.getLogger("warmstart.cache")

_REGISTRY_MAX_FIELDS = 1000  # a larger registry is not read: explaining must stay cheap for the server


class RemoteRegistry(RemoteConnection):
    """Register this namespace and key id on the server; list and query the registered ones."""

    components: Mapping[str, str] | None = None
    """What the namespace is made of (``namespace.components``); not registered when ``None``."""
    _registered = False

    @bounded
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

    @bounded
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
            with deadline(self.op_deadline_s):
                answers += pipe.execute()
        n = len(pairs)
        return [
            [pair for pair, found in zip(pairs, answers[i * n : (i + 1) * n], strict=True) if found]
            for i in range(len(entries))
        ]

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
