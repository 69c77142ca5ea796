"""Load benchmark of the shared cache server: warmstart's store vs raw redis-py, then a
fill to 3x ``maxmemory``.

Phase 1 (throughput): a ``warmstart server`` node; N client processes (default 32) each write W
artifact-sized values (sizes log-uniform between 1 KiB and 8 MiB), wait for each other, then run a
mix of 3 reads (of any process's values) to 1 write. Raw redis-py ``GET``/``SET`` and warmstart's
store (``RemoteTier``: signed pointer, zstd, BLAKE3 content address, chunks) run the same payloads
back to back, the server flushed in between, R times each (pairs alternate which side goes first).
Every read is checked: the value names its key and carries a SHA-256 digest of its body, so a
corrupted, truncated or mixed-up read is counted, never missed. Reported: throughput (logical bytes/s
and ops/s), the store/raw ratio as the median over back-to-back pairs (a shared machine's speed
drifts between pairs by 10% and more), p50/p99 latency, errors, corrupted reads, unexpected misses.

Phase 2 (eviction): a node with ``maxmemory`` 256 MiB (32 writers x the 8 MiB largest chunk, the
guide's sizing floor); the processes write through the store until 3x ``maxmemory`` has been
written, reading back as they go. The server must stay up and evict; clients must see misses, never
errors or corrupted values. Below the floor (``--fill-maxmemory 64MiB``), values in flight can
exceed ``maxmemory`` and Redis refuses some writes with OOM; reads still never fail.

Phase 3 (cost): the same plan in one client process, no contention: client and server CPU seconds
per GiB for each side, and the store's per-byte steps (zstd, BLAKE3) timed alone. Where clients and
the server share the CPUs, as on a 2-core machine, the ratio of these totals bounds phase 1's.

Run: ``.venv/bin/python benchmarks/server_load.py [--json FILE]`` (about five minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from warmstart._net import free_port
from warmstart.config import parse_size
from warmstart.server import Credentials, ServerOptions, start, stop

_HEADER_KEY = 64  # bytes of the key name at the start of every payload
_DIGEST = 32  # SHA-256 of the body, after the key
_KIND = "fx_graph"


# -- payloads -----------------------------------------------------------------------------------


def size_of(key: str, min_size: int, max_size: int) -> int:
    """Log-uniform size in [min_size, max_size], fixed by the key."""
    rng = random.Random(key)
    return int(math.exp(rng.uniform(math.log(min_size), math.log(max_size))))


_CORPUS: bytes = b""


def corpus() -> bytes:
    """32 MiB of what compiled artifacts are made of: Python source (generated wrapper code) and
    machine code (compiled kernels, C++ objects), read from this machine's Python and torch."""
    global _CORPUS
    if not _CORPUS:
        import importlib.util
        import sysconfig

        half = 16 * 2**20
        sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
        text = bytearray()
        for path in sources:
            text += path.read_bytes()
            if len(text) >= half:
                break
        spec = importlib.util.find_spec("torch")
        libs = (
            sorted(Path(spec.origin).parent.joinpath("lib").glob("*.so*"), key=lambda p: -p.stat().st_size)
            if spec and spec.origin
            else []
        )
        binary = bytearray()
        for path in libs or [Path(sys.executable).resolve()]:
            with open(path, "rb") as handle:
                handle.seek(min(path.stat().st_size // 4, 64 * 2**20))
                binary += handle.read(half - len(binary))
            if len(binary) >= half:
                break
        _CORPUS = bytes(text[:half]) + bytes(binary)
    return _CORPUS


def payload(key: str, size: int, compressible: bool) -> bytes:
    """``key`` (padded) + SHA-256 of the body + body. ``compressible`` bodies are a slice of
    :func:`corpus` at an offset fixed by the key (zstd gets about 4:1); otherwise random bytes."""
    body_len = size - _HEADER_KEY - _DIGEST
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    if compressible:
        data = corpus()
        offset = seed % (len(data) - body_len)
        body = data[offset : offset + body_len]
    else:
        body = np.random.default_rng(seed).integers(0, 256, body_len, dtype=np.uint8).tobytes()
    return key.encode().ljust(_HEADER_KEY) + hashlib.sha256(body).digest() + body


def verify(key: str, size: int, value: bytes) -> bool:
    """Whether ``value`` is exactly the payload written under ``key``."""
    if len(value) != size or value[:_HEADER_KEY].rstrip() != key.encode():
        return False
    body = memoryview(value)[_HEADER_KEY + _DIGEST :]
    return hashlib.sha256(body).digest() == value[_HEADER_KEY : _HEADER_KEY + _DIGEST]


# -- clients ------------------------------------------------------------------------------------


class _StoreClient:
    """Through warmstart's store: what a job's processes do."""

    def __init__(self, url: str, key_file: str, run: str) -> None:
        import logging

        from warmstart.compile_cache import signing
        from warmstart.compile_cache.remote import RemoteTier

        self.tier = RemoteTier(url, keys=signing.load_key_file(key_file), namespace=run)
        self.read_errors = self.write_errors = self._failures = 0
        # The store swallows errors (a job must never fail on the cache) and logs them: keep the
        # distinct messages so the report can say what went wrong.
        self.messages: set[str] = set()
        self._handler = logging.Handler(logging.DEBUG)
        self._handler.emit = lambda record: self.messages.add(record.getMessage()[:200])  # type: ignore[method-assign]
        logger = logging.getLogger("warmstart.cache")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self._handler)

    def close(self) -> None:
        import logging

        logging.getLogger("warmstart.cache").removeHandler(self._handler)
        self.tier.close()

    def _failed(self) -> bool:
        """Whether the store counted a failure since the last call. It only fails an operation
        that returns None (get) or False (put), so only those pay for reading its counters."""
        c = self.tier.stats.get("remote", _KIND)
        total = int(c.errors + c.timeouts + c.rejected + c.dropped)
        failed, self._failures = total > self._failures, total
        return failed

    def put(self, key: str, value: bytes) -> bool:
        ok = self.tier.put(_KIND, key, value)
        if not ok:
            self.write_errors += 1
            self._failed()
        return ok

    def get(self, key: str) -> bytes | None:
        value = self.tier.get(_KIND, key).value
        if value is None:
            self.read_errors += self._failed()
        return value

    def error_kinds(self) -> dict[str, int]:
        c = self.tier.stats.get("remote", _KIND)
        return {
            "errors": int(c.errors),
            "timeouts": int(c.timeouts),
            "rejected": int(c.rejected),
            "dropped": int(c.dropped),
        }


class _RawClient:
    """Plain redis-py GET/SET of the same bytes under the same credentials."""

    def __init__(self, url: str, key_file: str, run: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=60)
        self.prefix = f"ws:{run}:"
        self.read_errors = self.write_errors = 0
        self.messages: set[str] = set()

    def put(self, key: str, value: bytes) -> bool:
        try:
            return bool(self.client.set(self.prefix + key, value))
        except Exception as exc:
            self.write_errors += 1
            self.messages.add(f"{type(exc).__name__}: {exc}"[:200])
            return False

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get(self.prefix + key)
        except Exception as exc:
            self.read_errors += 1
            self.messages.add(f"{type(exc).__name__}: {exc}"[:200])
            return None

    def error_kinds(self) -> dict[str, int]:
        return {"errors": self.read_errors + self.write_errors}

    def close(self) -> None:
        self.client.close()


_CLIENTS = {"store": _StoreClient, "raw": _RawClient}


# -- workers ------------------------------------------------------------------------------------


@dataclass
class WorkerResult:
    t0: float = 0.0
    t_sync: float = 0.0
    """When the write-only first round ended (before the barrier) and the mixed round began (after it)."""
    t_mixed: float = 0.0
    t1: float = 0.0
    bytes_first: int = 0
    cpu_s: float = 0.0
    """CPU seconds this client process spent in its operations (load-independent cost)."""
    get_s: list[float] = field(default_factory=list)
    put_s: list[float] = field(default_factory=list)
    bytes: int = 0
    read_errors: int = 0
    """Reads that failed (the store turns them into misses; counted here as errors)."""
    write_errors: int = 0
    """Writes the server or the client refused."""
    misses: int = 0
    corrupt: int = 0
    hits: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    """What the store counted: errors, timeouts, rejected (bad signature), dropped (writes skipped)."""
    error_messages: list[str] = field(default_factory=list)


def _throughput_worker(side, url, key_file, run, index, plan, sizes, compressible, barrier, queue) -> None:
    client = _CLIENTS[side](url, key_file, run)
    values = {key: payload(key, sizes[key], compressible) for op, key in plan if op == "put"}
    result = WorkerResult()
    barrier.wait()
    result.t0 = time.monotonic()
    cpu0 = time.process_time()
    for op, key in plan:
        if op == "sync":
            result.t_sync, result.bytes_first = time.monotonic(), result.bytes
            barrier.wait()  # everyone's first writes are in before anyone reads them
            result.t_mixed = time.monotonic()
            continue
        start = time.perf_counter()
        if op == "put":
            ok = client.put(key, values[key])
            result.put_s.append(time.perf_counter() - start)
            result.bytes += sizes[key] if ok else 0
        else:
            value = client.get(key)
            result.get_s.append(time.perf_counter() - start)
            if value is None:
                result.misses += 1
            elif verify(key, sizes[key], value):
                result.hits += 1
                result.bytes += len(value)
            else:
                result.corrupt += 1
    result.t1 = time.monotonic()
    result.cpu_s = time.process_time() - cpu0
    result.read_errors, result.write_errors = client.read_errors, client.write_errors
    result.error_kinds = client.error_kinds()
    result.error_messages = sorted(client.messages)
    queue.put((index, result))


def _fill_worker(url, key_file, run, index, budget, min_size, max_size, barrier, queue) -> None:
    client = _StoreClient(url, key_file, run)
    rng = random.Random(f"fill-{index}")
    written: list[tuple[str, int]] = []
    result = WorkerResult()
    barrier.wait()
    result.t0 = time.monotonic()
    total, i = 0, 0
    while total < budget:
        key = f"fill-{index}-{i}"
        size = size_of(key, min_size, max_size)
        i += 1
        start = time.perf_counter()
        client.put(key, payload(key, size, compressible=False))
        result.put_s.append(time.perf_counter() - start)
        total += size
        written.append((key, size))
        _read_back(client, *rng.choice(written), result)
    for key, size in written:  # the oldest are evicted by now: misses, not errors
        _read_back(client, key, size, result)
    result.t1 = time.monotonic()
    result.bytes = total
    result.read_errors, result.write_errors = client.read_errors, client.write_errors
    result.error_kinds = client.error_kinds()
    result.error_messages = sorted(client.messages)
    queue.put((index, result))


def _read_back(client, key: str, size: int, result: WorkerResult) -> None:
    start = time.perf_counter()
    value = client.get(key)
    result.get_s.append(time.perf_counter() - start)
    if value is None:
        result.misses += 1
    elif verify(key, size, value):
        result.hits += 1
    else:
        result.corrupt += 1


def _run_processes(target, args_for, procs: int) -> list[WorkerResult]:
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=target, args=(*args_for(i), barrier, queue)) for i in range(procs)]
    for w in workers:
        w.start()
    results = [queue.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(60)
    return [r for _, r in sorted(results, key=lambda x: x[0])]


# -- phases -------------------------------------------------------------------------------------


def plans(procs: int, writes: int, mixed: int, seed: int) -> list[list[tuple[str, str]]]:
    """Per process: W writes of its own keys, a barrier, then 3 reads (of anyone's first-round
    keys) per write of a fresh key."""
    first_round = [f"p{p}-w{i}" for p in range(procs) for i in range(writes)]
    out = []
    for p in range(procs):
        rng = random.Random(f"{seed}-{p}")
        plan = [("put", f"p{p}-w{i}") for i in range(writes)] + [("sync", "")]
        for j in range(mixed):
            plan.append(("put", f"p{p}-m{j}") if j % 4 == 3 else ("get", rng.choice(first_round)))
        out.append(plan)
    return out


def summarize(results: list[WorkerResult]) -> dict[str, float | int]:
    wall = max(r.t1 for r in results) - min(r.t0 for r in results)
    gets = np.array([x for r in results for x in r.get_s]) * 1000
    puts = np.array([x for r in results for x in r.put_s]) * 1000
    ops = len(gets) + len(puts)
    both = np.concatenate([gets, puts])
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else 0.0  # noqa: E731
    phases = {}
    if any(r.t_sync for r in results):
        first = max(r.t_sync for r in results) - min(r.t0 for r in results)
        mixed = max(r.t1 for r in results) - min(r.t_mixed for r in results)
        phases = {
            "write_round_mib_per_s": sum(r.bytes_first for r in results) / first / 2**20,
            "mixed_round_mib_per_s": sum(r.bytes - r.bytes_first for r in results) / mixed / 2**20,
        }
    return {
        **phases,
        "wall_s": wall,
        "ops": ops,
        "client_cpu_s": sum(r.cpu_s for r in results),
        "bytes": sum(r.bytes for r in results),
        "ops_per_s": ops / wall,
        "mib_per_s": sum(r.bytes for r in results) / wall / 2**20,
        "p50_ms": pct(both, 50),
        "p99_ms": pct(both, 99),
        "get_p50_ms": pct(gets, 50),
        "get_p99_ms": pct(gets, 99),
        "put_p50_ms": pct(puts, 50),
        "put_p99_ms": pct(puts, 99),
        "hits": sum(r.hits for r in results),
        "misses": sum(r.misses for r in results),
        "corrupt": sum(r.corrupt for r in results),
        "read_errors": sum(r.read_errors for r in results),
        "write_errors": sum(r.write_errors for r in results),
        "errors": sum(r.read_errors + r.write_errors for r in results),
        "error_kinds": {
            name: sum(r.error_kinds.get(name, 0) for r in results)
            for name in ("errors", "timeouts", "rejected", "dropped")
        },
        "error_messages": sorted({m for r in results for m in r.error_messages}),
    }


def _start_server(workdir: Path, name: str, maxmemory: int):
    """A ``warmstart server`` node for one phase: (its directory, the writer's URL, the signing
    key file (Ed25519 private key), an admin client)."""
    directory = workdir / name
    state = start(ServerOptions(dir=directory, port=free_port(), maxmemory=maxmemory))
    creds = Credentials.load(directory)
    url, key_file = state.url("writer", creds), str(creds.signing_key_file)
    return directory, url, key_file, state.client(state.options.ports[0], credentials=creds)


def phase_throughput(args, workdir: Path, console) -> dict:
    directory, url, key_file, admin = _start_server(workdir, "throughput", parse_size(args.throughput_maxmemory))
    corpus()  # built once here; forked workers share it
    plan = plans(args.procs, args.writes, args.mixed, args.seed)
    keys = {key for p in plan for _, key in p if key}
    sizes = {key: size_of(key, args.min_size, args.max_size) for key in keys}
    runs: dict[str, list[dict]] = {"store": [], "raw": []}
    order = ["raw", "store"] * args.repeats
    if args.repeats > 1:
        order = [s for i in range(args.repeats) for s in (("raw", "store") if i % 2 == 0 else ("store", "raw"))]
    try:
        for n, side in enumerate(order):
            admin.flushall()
            run = f"bench{n}"
            console.log(f"throughput: {side} run {n + 1}/{len(order)}: {args.procs} processes")
            cpu_before = _server_cpu(admin)
            results = _run_processes(
                _throughput_worker,
                lambda i, side=side, run=run: (side, url, key_file, run, i, plan[i], sizes, not args.random_payloads),
                args.procs,
            )
            summary = summarize(results)
            summary["server_cpu_s"] = _server_cpu(admin) - cpu_before
            gib = summary["bytes"] / 2**30
            summary["client_cpu_s_per_gib"] = summary["client_cpu_s"] / gib
            summary["server_cpu_s_per_gib"] = summary["server_cpu_s"] / gib
            runs[side].append(summary)
            console.log(f"  {side}: {runs[side][-1]['mib_per_s']:.0f} MiB/s, {runs[side][-1]['ops_per_s']:.0f} ops/s")
    finally:
        admin.close()
        stop(directory)
    best = {side: max(rs, key=lambda r: r["mib_per_s"]) for side, rs in runs.items()}
    # The i-th raw and store runs ran back to back: their ratio sees the same machine. The median of
    # these paired ratios is the figure; a shared machine's speed drifts between pairs (by 10% and
    # more on this one), which best-of-N per side would mix into the ratio.
    pairs = list(zip(runs["raw"], runs["store"], strict=True))
    cost = lambda r: r["client_cpu_s_per_gib"] + r["server_cpu_s_per_gib"]  # noqa: E731
    paired = {
        "bytes": [s["mib_per_s"] / r["mib_per_s"] for r, s in pairs],
        "ops": [s["ops_per_s"] / r["ops_per_s"] for r, s in pairs],
        "write_round": [s["write_round_mib_per_s"] / r["write_round_mib_per_s"] for r, s in pairs],
        "mixed_round": [s["mixed_round_mib_per_s"] / r["mixed_round_mib_per_s"] for r, s in pairs],
        "cpu_bound": [cost(r) / cost(s) for r, s in pairs],
    }
    return {
        "runs": runs,
        "best": best,
        "paired_ratios": paired,
        **{f"ratio_{name}": float(np.median(values)) for name, values in paired.items()},
        "payload_bytes_total_per_run": sum(sizes[k] for p in plan for op, k in p if op in ("put", "get")),
    }


def phase_fill(args, workdir: Path, console) -> dict:
    maxmemory = parse_size(args.fill_maxmemory)
    directory, url, key_file, admin = _start_server(workdir, "fill", maxmemory)
    budget = args.fill_factor * maxmemory // args.procs
    console.log(f"fill: {args.procs} processes write {args.fill_factor}x maxmemory ({maxmemory / 2**20:.0f} MiB)")
    try:
        results = _run_processes(
            _fill_worker, lambda i: (url, key_file, "fill", i, budget, args.min_size, args.max_size), args.procs
        )
        info = admin.info()
        up = bool(admin.ping())
    finally:
        admin.close()
        stop(directory)
    summary = summarize(results)
    return {
        "maxmemory": maxmemory,
        "written_bytes": sum(r.bytes for r in results),
        "server_up": up,
        "evicted_keys": int(info["evicted_keys"]),
        "used_memory_peak": int(info["used_memory_peak"]),
        "used_memory": int(info["used_memory"]),
        **summary,
    }


def phase_cost(args, workdir: Path, console) -> dict:
    """Phase 3 (cost): CPU seconds per GiB of each side's work, in one client process on an
    otherwise idle server, so no contention muddies it: client and server CPU for the throughput
    phase's plan (its writes, then its 3:1 mix), and the store's own per-byte steps timed alone on
    the same values. Where clients and the server share the CPUs, as here, throughput is bounded by
    the inverse of the totals, so their ratio is the store's ceiling on such a machine."""
    directory, url, key_file, admin = _start_server(workdir, "cost", parse_size(args.throughput_maxmemory))
    plan = plans(min(args.procs, 8), args.writes, args.mixed, args.seed)
    ops = [(op, key) for p in plan for op, key in p if op == "put" and "-w" in key]
    ops += [(op, key) for p in plan for op, key in p if op != "sync" and not (op == "put" and "-w" in key)]
    sizes = {key: size_of(key, args.min_size, args.max_size) for _, key in ops}
    values = {key: payload(key, sizes[key], not args.random_payloads) for op, key in ops if op == "put"}
    total = sum(sizes[key] for _, key in ops) / 2**30
    costs: dict[str, list[tuple[float, float]]] = {"raw": [], "store": []}
    console.log(f"cost: {len(ops)} operations in one process, {args.cost_rounds} rounds per side")
    try:
        for n in range(args.cost_rounds):
            for side in ("raw", "store") if n % 2 == 0 else ("store", "raw"):
                admin.flushall()
                client = _CLIENTS[side](url, key_file, f"cost{n}")
                try:
                    client.put("warm-up", b"x" * 100)  # connect outside the measurement
                    server0, client0 = _server_cpu(admin), time.process_time()
                    for op, key in ops:
                        if op == "put":
                            client.put(key, values[key])
                        elif client.get(key) is None:
                            raise RuntimeError(f"cost phase: {side} lost {key}")
                    client_s, server_s = time.process_time() - client0, _server_cpu(admin) - server0
                finally:
                    client.close()
                costs[side].append((client_s / total, server_s / total))
    finally:
        admin.close()
        stop(directory)
    from warmstart.compile_cache import signing
    from warmstart.compile_cache.remote import RemoteTier

    tier = RemoteTier(
        url, keys=signing.load_key_file(key_file), namespace="steps"
    )  # its codec settings; never connects
    steps = _store_steps(tier, values, [key for op, key in ops if op == "get"], total)
    tier.close()
    median = lambda xs: float(np.median(xs))  # noqa: E731
    out = {
        side: {"client_s_per_gib": median([c for c, _ in rs]), "server_s_per_gib": median([s for _, s in rs])}
        for side, rs in costs.items()
    }
    for side in out:
        out[side]["total_s_per_gib"] = out[side]["client_s_per_gib"] + out[side]["server_s_per_gib"]
    ratios = [(r[0] + r[1]) / (s[0] + s[1]) for r, s in zip(costs["raw"], costs["store"], strict=True)]
    return {
        **out,
        "store_steps_s_per_gib": steps,
        "ceiling_ratios": ratios,
        "ceiling": median(ratios),
        "gib_per_round": total,
    }


def _store_steps(tier, values: dict[str, bytes], reads: list[str], total_gib: float) -> dict:
    """The store's per-byte steps on the cost phase's values, each timed alone, in CPU seconds per
    GiB of the whole mix (so they add up against the store's client cost)."""
    from warmstart.compile_cache import signing

    t0 = time.process_time()
    blobs = {key: tier._compress(value) for key, value in values.items()}
    compress_s = time.process_time() - t0
    t0 = time.process_time()
    for blob, _ in blobs.values():
        signing.blob_digest(blob)
    digest_put_s = time.process_time() - t0
    t0 = time.process_time()
    for key in reads:  # every read is of a first-round write
        blob, compressed = blobs[key]
        signing.blob_digest(blob)
        if compressed:
            tier._zd.decompress(blob)
    read_s = time.process_time() - t0
    # Signing (Ed25519): one signature per write and one verification per read, of a pointer record
    # (values up to 64 KiB compressed ride inline in it, so its signature covers them).
    records = {}
    t0 = time.process_time()
    for key, (blob, compressed) in blobs.items():
        inline = blob if len(blob) <= tier._inline_bytes else b""
        pointer = signing.Pointer(
            tier.namespace, "fx_graph", key, "" if inline else "0" * 64, len(blob), 0 if inline else 1, compressed, 0.0
        )
        records[key] = tier.keys.sign(pointer, inline)
    sign_s = time.process_time() - t0
    t0 = time.process_time()
    for key in reads:
        tier.keys.verify(records[key], namespace=tier.namespace, kind="fx_graph", key=key)
    verify_s = time.process_time() - t0
    return {
        "compress": compress_s / total_gib,
        "digest_on_write": digest_put_s / total_gib,
        "sign_on_write": sign_s / total_gib,
        "verify_on_read": verify_s / total_gib,
        "us_per_sign": sign_s / len(blobs) * 1e6,
        "us_per_verify": verify_s / max(1, len(reads)) * 1e6,
        "digest_and_decompress_on_read": read_s / total_gib,
        "stored_fraction": sum(len(b) for b, _ in blobs.values()) / sum(len(v) for v in values.values()),
    }


def _server_cpu(admin) -> float:
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _print_throughput(out, args, t: dict) -> bool:
    """Print the throughput table and ratios; return whether every read was intact and no op failed."""
    from rich.table import Table

    from warmstart import _defaults

    best = t["best"]
    level = "off" if args.compress_level == "off" else _defaults.COMPRESS_LEVEL
    table = Table(
        title=f"{args.procs} processes, values {args.min_size // 1024} KiB..{args.max_size // 2**20} MiB "
        f"({'random' if args.random_payloads else 'compiled code and Python source'}), store zstd level "
        f"{level}; each side's best of {args.repeats} runs",
        title_justify="left",
    )
    for col in (
        "",
        "MiB/s",
        "write round MiB/s",
        "3:1 round MiB/s",
        "client / server CPU s per GiB",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "get p50/p99 ms",
        "put p50/p99 ms",
        "errors",
        "corrupt",
        "misses",
    ):
        table.add_column(col, justify="left" if not col else "right")
    for side in ("raw", "store"):
        r = best[side]
        table.add_row(
            side,
            f"{r['mib_per_s']:.0f}",
            f"{r['write_round_mib_per_s']:.0f}",
            f"{r['mixed_round_mib_per_s']:.0f}",
            f"{r['client_cpu_s_per_gib']:.1f} / {r['server_cpu_s_per_gib']:.1f}",
            f"{r['ops_per_s']:.0f}",
            f"{r['p50_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            f"{r['get_p50_ms']:.1f} / {r['get_p99_ms']:.1f}",
            f"{r['put_p50_ms']:.1f} / {r['put_p99_ms']:.1f}",
            str(r["errors"]),
            str(r["corrupt"]),
            str(r["misses"]),
        )
    out.print(table)
    spread = lambda name: "/".join(f"{x * 100:.0f}" for x in t["paired_ratios"][name])  # noqa: E731
    out.print(
        f"store / raw throughput, median of {len(t['paired_ratios']['bytes'])} back-to-back pairs "
        f"(each pair's ratio in brackets): {t['ratio_bytes'] * 100:.0f}% overall ({spread('bytes')}), "
        f"{t['ratio_ops'] * 100:.0f}% of ops; "
        f"write round {t['ratio_write_round'] * 100:.0f}% ({spread('write_round')}), "
        f"3:1 read/write round {t['ratio_mixed_round'] * 100:.0f}% ({spread('mixed_round')}); from CPU cost per GiB "
        f"(client + server): {t['ratio_cpu_bound'] * 100:.0f}% ({spread('cpu_bound')})"
    )
    return all(best[s]["errors"] == 0 and best[s]["corrupt"] == 0 and best[s]["misses"] == 0 for s in best)


def _print_cost(out, c: dict) -> None:
    from rich.table import Table

    table = Table(
        title="CPU seconds per GiB moved, one client process, server otherwise idle (medians)", title_justify="left"
    )
    for col in ("", "client", "server", "total"):
        table.add_column(col, justify="left" if not col else "right")
    for side in ("raw", "store"):
        r = c[side]
        table.add_row(
            side, f"{r['client_s_per_gib']:.2f}", f"{r['server_s_per_gib']:.2f}", f"{r['total_s_per_gib']:.2f}"
        )
    steps = c["store_steps_s_per_gib"]
    rest = (
        c["store"]["client_s_per_gib"]
        - steps["compress"]
        - steps["digest_on_write"]
        - steps["sign_on_write"]
        - steps["digest_and_decompress_on_read"]
        - steps["verify_on_read"]
    )
    for name, value in (
        ("  of which zstd compress (writes)", steps["compress"]),
        ("  of which BLAKE3 (writes)", steps["digest_on_write"]),
        (f"  of which Ed25519 signing (writes, {steps['us_per_sign']:.0f} us each)", steps["sign_on_write"]),
        ("  of which BLAKE3 + zstd decompress (reads)", steps["digest_and_decompress_on_read"]),
        (f"  of which Ed25519 verification (reads, {steps['us_per_verify']:.0f} us each)", steps["verify_on_read"]),
        ("  of which the rest (redis-py on fewer bytes, round trips)", rest),
    ):
        table.add_row(name, f"{value:.2f}", "", "")
    out.print(table)
    out.print(
        f"raw / store CPU per GiB: {c['ceiling'] * 100:.0f}% "
        f"({'/'.join(f'{x * 100:.0f}' for x in c['ceiling_ratios'])}): the store's throughput ceiling where "
        f"clients and server share the CPUs; stored bytes {steps['stored_fraction']:.2f} of the values"
    )


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=32, help="client processes")
    parser.add_argument("--writes", type=int, default=16, help="first-round writes per process")
    parser.add_argument(
        "--mixed", type=int, default=48, help="mixed ops per process after the barrier (3 reads : 1 write)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs per side, in back-to-back pairs, alternating which goes first"
    )
    parser.add_argument("--min-size", type=parse_size, default=parse_size("1KiB"))
    parser.add_argument("--max-size", type=parse_size, default=parse_size("8MiB"))
    parser.add_argument(
        "--random-payloads", action="store_true", help="incompressible payloads (worst case for the store)"
    )
    parser.add_argument("--throughput-maxmemory", default="4GiB")
    parser.add_argument(
        "--fill-maxmemory",
        default="256MiB",
        help="the guide's sizing floor for 32 writers of up to 8 MiB values (32 x 8 MiB)",
    )
    parser.add_argument("--fill-factor", type=int, default=3)
    parser.add_argument(
        "--compress-level",
        default=None,
        help="experiment: override the store's zstd level (warmstart._defaults.COMPRESS_LEVEL), "
        "or 'off' to store values uncompressed, to measure what compression costs",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-fill", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--cost-rounds", type=int, default=4, help="rounds per side of the one-process cost phase")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    if args.compress_level is not None:  # workers are forked: they inherit the override
        from warmstart import _defaults
        from warmstart.compile_cache import remote

        if args.compress_level == "off":
            remote._COMPRESS_MIN = 2**62
        else:
            _defaults.COMPRESS_LEVEL = int(args.compress_level)

    with tempfile.TemporaryDirectory(prefix="ws-server-bench-") as tmp:
        import os

        report = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(),
        }
        if not args.skip_throughput:
            report["throughput"] = phase_throughput(args, Path(tmp), console)
        if not args.skip_fill:
            report["fill"] = phase_fill(args, Path(tmp), console)
        if not args.skip_cost:
            report["cost"] = phase_cost(args, Path(tmp), console)

    report["loadavg_after"] = os.getloadavg()
    out = Console(width=160)
    ok = True
    if "throughput" in report:
        ok = _print_throughput(out, args, report["throughput"])
    if "fill" in report:
        f = report["fill"]
        out.print(
            f"fill: wrote {f['written_bytes'] / 2**20:.0f} MiB into maxmemory {f['maxmemory'] / 2**20:.0f} MiB; "
            f"server up: {f['server_up']}; evicted keys: {f['evicted_keys']}; peak memory "
            f"{f['used_memory_peak'] / 2**20:.0f} MiB; reads: {f['hits']} hits, {f['misses']} misses, "
            f"{f['read_errors']} errors, {f['corrupt']} corrupt; writes refused: {f['write_errors']}"
            + (f" ({'; '.join(f['error_messages'])})" if f["error_messages"] else "")
        )
    if "cost" in report:
        _print_cost(out, report["cost"])
    out.print(
        f"machine: {report['cpus']} CPUs, 1-min load average {report['loadavg_before'][0]:.1f} before, "
        f"{report['loadavg_after'][0]:.1f} after (other work on the machine skews both sides alike)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
    if "fill" in report:
        f = report["fill"]
        ok = ok and f["server_up"] and f["evicted_keys"] > 0 and f["errors"] == 0 and f["corrupt"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
