"""Every default warmstart uses, with its unit, in one place."""

from __future__ import annotations

CACHE_SIZE_BYTES = 10 * 1024**3  # local tier limit: 10 GiB
CACHE_MODE = "rw"

REMOTE_CONNECT_TIMEOUT_S = 0.5  # connect timeout for the remote tier
REMOTE_SOCKET_TIMEOUT_S = 2.0  # per-command timeout for the remote tier (large values take a while)
BREAKER_COOLDOWN_S = 30.0  # how long an open circuit breaker keeps the remote tier off

CHUNK_BYTES = 8 * 1024**2  # remote values are split into chunks of at most this size
COMPRESS_LEVEL = -3  # zstd fast level: artifacts to ~0.36 of their size, decompressed 2x as fast as level 1 (docs/bench/server.md)
INLINE_BYTES = 64 * 1024  # values up to this size (after compression) live in their signed pointer record
REMOTE_TTL_S = 30 * 24 * 3600  # remote entries expire after 30 days unless touched by LRU first

FLUSH_INTERVAL_S = 1.0  # ETT event files are flushed at least this often
