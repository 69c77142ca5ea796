"""Who may do what on the shared cache server: the ACL users and their rules.

This module owns the access policy and nothing else. Four users exist: ``default`` is switched
off, so anonymous clients can do nothing; ``writer`` and ``reader`` get an *allow-list*: every
command is refused (``-@all``) except the few the store and the CLI send, so a command Redis adds
in a later release, or one that sits in an unexpected category, is refused too. ``reader``'s key
permission is ``%R~``, read-only, on top of its read-only command list. ``admin`` is what
``warmstart server status|stop|rotate`` and cluster forming use. Every warmstart key starts with
:data:`KEY_PREFIX`; keys outside it are invisible to writers and readers. Passwords are stored in
the ACL file as SHA-256 hashes, never in clear.

The lists were drawn from what the clients actually send (``INFO commandstats`` while the store,
``warmstart cache doctor|clear`` and ``benchmarks/server_load.py`` ran against a single node and a
Cluster, redis-py 8.1) and checked on Debian's ``redis-server`` 7.0.15.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from warmstart.compile_cache.keyspace import KEY_PREFIX

KEY_PATTERN = KEY_PREFIX + "*"

USERS = ("admin", "writer", "reader")
"""Users with a generated password; ``default`` exists too but is switched off."""

CONNECTION = ("auth", "hello", "ping", "readonly", "asking")
"""Logging in and staying connected: AUTH/HELLO (redis-py authenticates with HELLO), PING (the
store's health check), READONLY (reads from Cluster replicas) and ASKING (a Cluster redirect while a
slot migrates). Not CLIENT SETNAME (the store never names its connections) nor CLIENT SETINFO: Redis
7.0 does not know it (an ACL file naming it does not load), and redis-py ignores its refusal on
7.2+."""

CLUSTER_TOPOLOGY = (
    "cluster|slots",
    "cluster|shards",
    "cluster|nodes",
    "cluster|info",
    "cluster|myid",
    "cluster|keyslot",
    "command",
)
"""What redis-py's RedisCluster sends to learn the topology (CLUSTER SLOTS) and where a command's
keys are (COMMAND, and COMMAND GETKEYS for commands it cannot parse itself); all read-only
introspection. Redis's ACL cannot allow a bare COMMAND without its subcommands (COUNT, DOCS, INFO,
LIST, GETKEYS...), which only describe commands."""

READ = ("get", "exists", "strlen", "getrange", "hlen", "hkeys", "hgetall")
"""The store's reads: a lease (GET), a pointer record (GETRANGE of at most its largest size),
whether an entry is there (EXISTS, for ``cache explain``), a blob chunk's length and bytes (STRLEN,
GETRANGE, pipelined), and the namespace registry (HLEN, then HGETALL or HKEYS when it is small) that
``cache explain`` and ``cache clear`` read."""

WRITE = (
    "set",
    "hset",
    "hdel",
    "unlink",
    "del",
    "sadd",
    "srem",
    "sscan",
    "watch",
    "unwatch",
    "multi",
    "exec",
    "discard",
)
"""The store's writes: SET (NX EX for entries; PX for leases), HSET/HDEL (a namespace's field of
the namespace registry: set once per writing process, removed by ``cache clear``), UNLINK/DEL (``cache clear``,
``doctor``'s probe, a lease's release), SADD/SREM/SSCAN (each namespace's index of the keys it stored,
which ``cache clear`` and ``doctor``'s key-id count walk: no SCAN, which would show a writer the name of
every key on the server and walk the whole key space in one call of any COUNT), and
WATCH/UNWATCH/MULTI/EXEC/DISCARD, the compare-and-set transactions that renew and release a lease
only while it is still the renewer's (the ACL refuses scripting, which would do the same).
Neither user has SCAN; ``doctor`` with reader credentials skips its key-id check."""

RULES: Mapping[str, tuple[str, ...]] = {
    "admin": ("~*", "&*", "+@all"),
    "writer": (
        f"~{KEY_PATTERN}",
        "resetchannels",
        "-@all",
        *(f"+{c}" for c in (*CONNECTION, *CLUSTER_TOPOLOGY, *READ, *WRITE)),
    ),
    "reader": (
        f"%R~{KEY_PATTERN}",
        "resetchannels",
        "-@all",
        *(f"+{c}" for c in (*CONNECTION, *CLUSTER_TOPOLOGY, *READ)),
    ),
}
"""ACL rules per user, applied left to right after ``reset``. Nothing but the listed commands:
in particular no FLUSHALL/FLUSHDB, CONFIG, KEYS, INFO, scripting (EVAL, FUNCTION),
pub/sub, and none of the write commands the store does not use (SETRANGE, SETBIT, APPEND, RENAME,
EXPIRE, ...) or reads that cost the server more than they give (LCS, SRANDMEMBER, HRANDFIELD)."""


def password_hash(password: str) -> str:
    """The ``#<sha256>`` form Redis accepts in an ACL file instead of a clear-text password."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def render_acl_file(passwords: Mapping[str, str]) -> str:
    """The ACL file text for ``passwords`` (user name -> password; one per name in :data:`USERS`)."""
    # Redis ACL files allow no comments: the rules' origin is documented in redis.conf instead.
    lines = ["user default reset off"]
    for user in USERS:
        lines.append(" ".join(("user", user, "reset", "on", password_hash(passwords[user]), *RULES[user])))
    return "\n".join(lines) + "\n"
