"""Who may do what on the shared cache server: the ACL users and their rules.

This module owns the access policy and nothing else. Four users exist: ``default`` is switched
off, so anonymous clients can do nothing; ``writer`` reads and writes warmstart's keys and may run
no administrative or dangerous command; ``reader`` may only read warmstart's keys (its key
permission is ``%R~``, read-only, so even a write command that slipped into a category is refused);
``admin`` is what ``warmstart server status|stop`` and cluster forming use. Every warmstart key
starts with :data:`KEY_PREFIX`; keys outside it are invisible to writers and readers.
Passwords are stored in the ACL file as SHA-256 hashes, never in clear.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

KEY_PREFIX = "ws:"
"""Every key the store writes starts with this; the writer and reader users see nothing else."""
KEY_PATTERN = KEY_PREFIX + "*"

USERS = ("admin", "writer", "reader")
"""Users with a generated password; ``default`` exists too but is switched off."""

# What redis-py's RedisCluster client sends to learn the topology. These subcommands are in no
# read or write category, so clients of a Cluster need them named.
_CLUSTER_TOPOLOGY = ("+cluster|slots", "+cluster|shards", "+cluster|nodes", "+cluster|info",
                     "+cluster|myid", "+cluster|keyslot")

# Named on top of -@admin -@dangerous, which already cover them: the guarantee the guide promises
# must not hinge on how one Redis release files a command into categories.
_NEVER = ("-flushall", "-flushdb", "-config", "-shutdown", "-keys", "-debug", "-module", "-acl",
          "-eval", "-evalsha", "-fcall", "-function", "-script", "-migrate", "-restore", "-monitor",
          "-replicaof", "-slaveof", "-save", "-bgsave", "-bgrewriteaof", "-swapdb", "-info")

# @connection: AUTH, HELLO, PING, SELECT, CLIENT SETNAME/SETINFO/ID, READONLY, ASKING (cluster
# redirects); @transaction: MULTI/EXEC, which redis-py pipelines send by default.
_COMMON = ("+@connection", "+@transaction", *_CLUSTER_TOPOLOGY)

RULES: Mapping[str, tuple[str, ...]] = {
    "admin": ("~*", "&*", "+@all"),
    "writer": (f"~{KEY_PATTERN}", "resetchannels", "+@read", "+@write", *_COMMON,
               "-@admin", "-@dangerous", "-@scripting", "-@pubsub", *_NEVER),
    "reader": (f"%R~{KEY_PATTERN}", "resetchannels", "+@read", *_COMMON,
               "-@write", "-@admin", "-@dangerous", "-@scripting", "-@pubsub", *_NEVER),
}
"""ACL rules per user, applied left to right after ``reset``."""


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
