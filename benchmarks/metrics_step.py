"""Cost of the recorder's hot calls (target: ``step()`` <= 5 us median), with its flusher thread running.

    .venv/bin/python benchmarks/metrics_step.py [--calls 1000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from warmstart.metrics import Recorder

BATCH = 10_000


def _per_call_us(fn, batches: int) -> list[float]:
    """Microseconds per call of ``fn(i)``, one figure per batch, the empty loop's cost taken out."""
    costs = []
    for _ in range(batches):
        start = time.perf_counter()
        for i in range(BATCH):
            fn(i)
        costs.append((time.perf_counter() - start) / BATCH * 1e6)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1_000_000)
    args = parser.parse_args()
    batches = max(1, args.calls // BATCH)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, job="bench", rank=0, attempt=0, flush_interval_s=1.0)
        empty = statistics.median(_per_call_us(lambda i: None, batches))

        def span(i: int) -> None:
            with rec.span("eval"):
                pass

        rows = [("step(n)", rec.step), ("step(n, samples=512)", lambda i: rec.step(i, samples=512)),
                ("checkpoint_committed(n)", rec.checkpoint_committed), ("with span(...)", span)]
        for name, fn in rows:
            costs = _per_call_us(fn, batches)
            median = statistics.median(costs) - empty
            p90 = sorted(costs)[int(len(costs) * 0.9)] - empty
            print(f"{name:26s} median {median:5.2f} us   p90 {p90:5.2f} us   ({len(costs) * BATCH:,} calls)")
        # The calls above come far faster than any training loop's, so the flusher falls behind here;
        # what is left shows the serializer's throughput (it runs off the hot path, in the flusher).
        pending = len(rec._buf)
        start = time.perf_counter()
        rec.close()
        took = time.perf_counter() - start
        print(f"flush: {pending:,} buffered events serialized and written in {took:.2f} s "
              f"({pending / took / 1e3:,.0f} k events/s); file {os.path.getsize(rec.path) / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
