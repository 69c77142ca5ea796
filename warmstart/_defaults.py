"""Every default warmstart uses, with its unit, in one place."""

from __future__ import annotations

CACHE_SIZE_BYTES = 10 * 1024**3  # local tier limit: 10 GiB
CACHE_MODE = "rw"

REMOTE_CONNECT_TIMEOUT_S = 0.5  # connect timeout for the remote tier
REMOTE_SOCKET_TIMEOUT_S = 2.0  # longest wait for any one socket read or write of the remote tier
# Bytes asked of the socket per read (redis-py's default: 64 KiB). A thread that reads while another
# one runs Python (the compile's code generation) waits for the GIL after every read: a 37 MB blob in
# 64 KiB reads took 2.1 s that way, against 0.3 s alone; in 1 MiB reads, 0.5 s.
REMOTE_SOCKET_READ_BYTES = 1024 * 1024
BREAKER_COOLDOWN_S = 30.0  # how long an open circuit breaker keeps the remote tier off
# Deadline of one whole remote operation (a lookup, a write, a probe), however the server spreads its
# bytes: REMOTE_OP_DEADLINE_S seconds plus the value's size at REMOTE_MIN_BYTES_PER_S. A server that
# misses it costs that once, then the circuit breaker keeps the tier off. Connecting is bounded apart,
# by REMOTE_CONNECT_TIMEOUT_S per node tried.
REMOTE_OP_DEADLINE_S = 2.0  # seconds
REMOTE_MIN_BYTES_PER_S = 16 * 1024**2  # 16 MiB/s: a 150 MB value may take 2 s + 9 s
# Slow is a fault: REMOTE_SLOW_IN_A_ROW operations in a row that each take more than REMOTE_SLOW_SHARE of
# their deadline (0.5 s of 2 s; a healthy server answers in milliseconds) open the circuit breaker, and
# its probe passes only a PING that is fast.
REMOTE_SLOW_SHARE = 0.25
REMOTE_SLOW_IN_A_ROW = 3
LOCAL_BACKGROUND_BYTES = (
    8 * 1024**2
)  # local writes of values this large (a 155 MB precompiled header) go to the background writer
WRITER_NICE = 10  # the background writer's niceness (Linux, per thread): below the compile, still moving
# A large background write that holds no lease (a 155 MB precompiled header: compressing, hashing and
# writing it) waits while this process compiles, for at most this long: on a machine whose cores the
# compile keeps busy, even a niced writer's share comes out of the compile (2-4% of a cold compile).
LARGE_WRITE_DEFER_S = 300.0
LARGE_WRITE_QUIET_S = 1.0  # ... and until no compile has run for this long (the gaps between a compile's parts)
WRITE_QUEUE_BYTES = 256 * 1024**2  # background writes held in memory at most (256 MiB); more are dropped
LOCAL_LOCK_TIMEOUT_S = 1.0  # the local tier's SQLite lock wait; past it the tier is off for the process
EXIT_FLUSH_S = 5.0  # at exit, background writes get at most this many seconds, then are dropped

CHUNK_BYTES = 8 * 1024**2  # remote values are split into chunks of at most this size
COMPRESS_LEVEL = (
    -3
)  # zstd fast level: artifacts to ~0.36 of their size, decompressed 2x as fast as level 1 (docs/bench/server.md)
INLINE_BYTES = 64 * 1024  # values up to this size (after compression) live in their signed pointer record
REMOTE_TTL_S = 30 * 24 * 3600  # remote entries expire after 30 days unless touched by LRU first

# Single-flight compiles (single_flight.py): a process that misses an entry another process is
# compiling waits for it at most COMPILE_WAIT_S, looking at the lease every LEASE_POLL_S at most; a
# Redis lease not renewed for LEASE_TTL_S (its holder died) lapses, and a waiter takes it over.
COMPILE_WAIT_S = 300.0
# The most time one process spends waiting on the cache in total (WARMSTART_MAX_WAIT_S), every wait
# included: remote and local tier operations on the job's threads, peers' leases, the exit flush. A
# healthy warm start of the reference job waits well under a second in all; its cold compile takes
# 20-50 s here. 60 s lets a rank wait for a peer's compile of that size, and caps what any fault costs.
MAX_WAIT_S = 60.0
LEASE_TTL_S = 3.0
#: The furthest ahead a lease record may claim to last: one that claims more is not honoured.
LEASE_MAX_S = 600.0
LEASE_POLL_S = 0.25

FLUSH_INTERVAL_S = 1.0  # ETT event files are flushed at least this often

# Live metrics (metrics/live.py): the exporter recomputes the job's ETT every METRICS_INTERVAL_S at
# least, and never more often than keeps that work under METRICS_MAX_CPU_SHARE of one core (a long
# job's recomputation grows with its events); the recent ETT% covers the last METRICS_WINDOW_S.
METRICS_INTERVAL_S = 15.0
METRICS_WINDOW_S = 300.0
METRICS_MAX_CPU_SHARE = 0.02

# Fetch ahead (compile_cache/fetch_ahead.py): the most a manifest names, and the most bytes of entries
# a process holds in memory from it before its lookups take them.
FETCH_AHEAD_ENTRIES = 4096
FETCH_AHEAD_BYTES = 256 * 1024**2

# The sharding planner's child (init_pipeline/plan_cache.py) computes without waiting: one that has
# used no CPU for this long is stuck on a lock copied at its fork, and the plan is made in the rank.
PLANNER_CHILD_STALL_S = 10.0
