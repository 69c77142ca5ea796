"""Cost of the recorder's hot calls (median microseconds per call), with its flusher thread running.

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
        rec.close()
        # Serializing happens off the hot path, in the flusher thread; its throughput, measured alone:
        alone = Recorder(tmp, job="bench", rank=1, attempt=0, flush_interval_s=0)
        for i in range(200_000):
            alone.step(i, samples=512)
        start = time.perf_counter()
        alone.flush()
        took = time.perf_counter() - start
        alone.close()
        print(f"flush: 200,000 events serialized and appended in {took:.2f} s "
              f"({200_000 / took / 1e3:,.0f} k events/s, {took / 200_000 * 1e6:.1f} us each)")

if __name__ == "__main__":
    main()
