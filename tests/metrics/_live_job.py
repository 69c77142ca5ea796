"""A short real job for the live-metrics tests: ETT events through the process-wide recorder (whose
exporter ``WARMSTART_METRICS_*`` turns on) and, with ``--cache-dir``, a few compile-cache lookups.

    python _live_job.py fail|finish|start-up [--cache-dir DIR [--after-first-textfile]] [--hold]

``fail``: an attempt that compiles, trains steps 0-5, commits step 3, then dies of an infra failure.
``finish``: the restart: loads the checkpoint, trains steps 4-9, commits step 9 and ends. With
``--hold`` the job prints ``ready`` once its events are written and waits until its standard input
closes, so that a test can scrape its final figures. ``start-up``: an attempt that begins its
``imports`` span and then keeps a core busy, writing nothing, until its standard input closes.
``--after-first-textfile``: the cache lookups wait for the exporter's first textfile, so that its
thread has looked at the cache before them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from warmstart.metrics import get_recorder


def _cache_lookups(cache_dir: str) -> None:
    """One miss, then a hit, on a local-only store made the process-wide one."""
    from warmstart import compile_cache
    from warmstart.config import Settings

    # Persisting its counts, as a job's store does: at exit it hands them to the cache's stats file.
    store = compile_cache.open_store(Settings.from_env({"WARMSTART_CACHE_DIR": cache_dir}))
    compile_cache.set_store(store)
    assert store.get("fx_graph", "graph-1").value is None
    store.put("fx_graph", "graph-1", b"compiled" * 100, sync=True)
    assert store.get("fx_graph", "graph-1").value is not None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("fail", "finish", "start-up"))
    parser.add_argument("--cache-dir")
    parser.add_argument("--after-first-textfile", action="store_true")
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    rec = get_recorder()
    rec.attempt_start(devices=4)
    if args.after_first_textfile:
        textfile = Path(os.environ["WARMSTART_METRICS_TEXTFILE"])
        deadline = time.monotonic() + 60
        while not textfile.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    if args.cache_dir:
        _cache_lookups(args.cache_dir)
    if args.mode == "start-up":
        _busy_start_up(rec)
        return
    if args.mode == "fail":
        with rec.span("compile"):
            time.sleep(0.05)
        for step in range(6):
            rec.step(step, samples=32)
            time.sleep(0.02)
            if step == 3:
                rec.checkpoint_committed(3)
        rec.failure("NCCL timeout", "infra")
        rec.attempt_end()
    else:
        with rec.span("checkpoint_load"):
            time.sleep(0.05)
        for step in range(4, 10):
            rec.step(step, samples=32)
            time.sleep(0.02)
        rec.checkpoint_committed(9)
        rec.train_end()
        time.sleep(0.02)
        rec.attempt_end()
    rec.flush()
    if args.hold:
        print("ready", flush=True)
        sys.stdin.read()


def _busy_start_up(rec) -> None:
    import threading

    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    rec.begin("imports")
    rec.flush()
    print("started", flush=True)
    while not done.is_set():  # pure Python work holding the GIL, as imports and tracing do
        sum(i * i for i in range(10_000))
    rec.end("imports")
    rec.train_end()
    rec.attempt_end()


if __name__ == "__main__":
    main()
