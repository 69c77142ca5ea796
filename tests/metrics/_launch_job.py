"""A job process for test_launch.py: records its start-up as a training script would, importing the
module named by its argument inside an ``imports`` span, then one short step. Prints the seconds the
import took (measured here, to check the span against)."""

from __future__ import annotations

import importlib
import sys
import time

from warmstart.metrics import get_recorder

rec = get_recorder()
rec.attempt_start(devices=1)  # in the job, as in the reference job; the launcher recorded its own first
started = time.perf_counter()
with rec.span("imports"):
    importlib.import_module(sys.argv[1])
print(time.perf_counter() - started)
rec.step(0, samples=1)
time.sleep(0.1)
rec.train_end()
rec.attempt_end()
rec.close()
