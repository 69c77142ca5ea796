"""Cost of the recorder's hot calls (median microseconds per call), with its flusher thread running
and, with ``--live``, the live-metrics exporter too (textfile and HTTP endpoint, refreshing every 0.5 s).

    .venv/bin/python benchmarks/metrics_step.py [--calls 1000000] [--live]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

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


def _start_live(rec: Recorder, tmp: str):
    """The exporter of ``rec``'s job on a free port and a textfile in ``tmp``, refreshing every 0.5 s."""
    from warmstart.config import MetricsSettings
    from warmstart.metrics.live import start_exporter

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return start_exporter(rec, MetricsSettings(port=port, textfile=Path(tmp) / "bench.prom", interval_s=0.5))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--live", action="store_true", help="run the live-metrics exporter meanwhile")
    args = parser.parse_args()
    batches = max(1, args.calls // BATCH)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, job="bench", rank=0, attempt=0, flush_interval_s=1.0)
        exporter = _start_live(rec, tmp) if args.live else None
        empty = statistics.median(_per_call_us(lambda i: None, batches))

        def span(i: int) -> None:
            with rec.span("eval"):
                pass

        rows = [
            ("step(n)", rec.step),
            ("step(n, samples=512)", lambda i: rec.step(i, samples=512)),
            ("checkpoint_committed(n)", rec.checkpoint_committed),
            ("with span(...)", span),
        ]
        for name, fn in rows:
            costs = _per_call_us(fn, batches)
            median = statistics.median(costs) - empty
            p90 = sorted(costs)[int(len(costs) * 0.9)] - empty
            print(f"{name:26s} median {median:5.2f} us   p90 {p90:5.2f} us   ({len(costs) * BATCH:,} calls)")
        rec.close()
        if exporter is not None:
            exporter.stop()
            snap = exporter.snapshot
            print(
                f"live exporter: last refresh saw {snap.steps if snap else 0:,} steps; "
                f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB"
            )
        # Serializing happens off the hot path, in the flusher thread; its throughput, measured alone:
        alone = Recorder(tmp, job="bench", rank=1, attempt=0, flush_interval_s=0)
        for i in range(200_000):
            alone.step(i, samples=512)
        start = time.perf_counter()
        alone.flush()
        took = time.perf_counter() - start
        alone.close()
        print(
            f"flush: 200,000 events serialized and appended in {took:.2f} s "
            f"({200_000 / took / 1e3:,.0f} k events/s, {took / 200_000 * 1e6:.1f} us each)"
        )


if __name__ == "__main__":
    main()
