"""A background compile's worker: ``python -m warmstart.compile_cache.background_worker JOB``.

Started by :mod:`warmstart.compile_cache.background` with the job's environment (warmstart's store
on, ``WARMSTART_COMPILE_WORKER=1``: no ETT events, no background mode of its own). It loads the job
file (the code, how ``torch.compile`` was called, the input specs of each call that made the job's
Dynamo compile), compiles the code as the job would have, running it forward and backward on inputs
made to each call's specs in turn, waits until the store has written everything, and then creates
``<key>.done`` next to the job file.

It runs at a lower CPU priority, with the job's intra-op thread count (Inductor writes it into the code
it generates), and holds the lock file it was given until it exits (inherited: the lock lasts as long
as the worker), so that other processes of the host wait on it instead of starting a worker of their
own. It ends within ``WATCH_S`` of its job's end (Linux: the job's pid and start time in ``/proc``).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from pathlib import Path

from warmstart import torch_internals
from warmstart.compile_cache.background_job import TensorSpec, start_time
from warmstart.config import compile_worker_job

#: How long the worker waits for the store's background writes before it says it is done.
FLUSH_TIMEOUT_S = 120.0

#: How often the worker checks that its job is still there.
WATCH_S = 0.5


def _end_with_the_job(job: str) -> None:
    """Exit as soon as the job that started this worker has ended (killed, failed, finished): a worker
    never outlives its job, whatever cleans up after the job (a scheduler, torchrun's restart).
    ``job`` is ``<pid>:<start time>`` as the job read it of itself: a job that ended before its
    worker got here, or whose pid another process has now, is gone."""
    pid, start = job.split(":", 1)

    def gone() -> bool:
        return start_time(int(pid)) != start

    if gone():
        os._exit(0)

    def watch() -> None:
        while not gone():
            time.sleep(WATCH_S)
        os._exit(0)

    threading.Thread(target=watch, name="ws-worker-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    _end_with_the_job(compile_worker_job())
    job_path = Path(argv[0])
    with open(job_path, "rb") as f:
        blob = f.read()
    job_path.unlink(missing_ok=True)
    key = job_path.name.split("-", 1)[0]
    os.nice(10)
    import torch

    where = pickle.loads(blob)
    sys.path[:] = where["sys_path"]
    os.chdir(where["cwd"])
    payload = pickle.loads(where["code"])
    # Inductor writes the thread count into the C++ it generates: the job's, or its keys differ.
    torch.set_num_threads(payload["num_threads"])
    tree_map = torch_internals.require("tree_map")
    tree_leaves = torch_internals.require("tree_leaves")

    def make(value):
        return value.make() if isinstance(value, TensorSpec) else value

    target = payload["target"]
    start = time.perf_counter()
    with torch.set_grad_enabled(payload["grad_enabled"]):
        if payload["how"] == "module_compile":
            target.compile(**payload["compile_kwargs"])
            compiled = target
        else:
            compiled = torch.compile(target, **payload["compile_kwargs"])
        # Every call that made the job's Dynamo compile, in order: the last one's compile is the one
        # asked for, and the ones before it make Dynamo decide as the job's did (what it marks dynamic).
        for args, kwargs in payload["calls"]:
            out = compiled(*tree_map(make, args), **tree_map(make, kwargs))
            leaves = tree_leaves(out)
            tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.stack([t.float().sum() for t in tensors]).sum().backward()
    from warmstart.compile_cache import get_store

    seconds = f"{time.perf_counter() - start:.3f}"
    store = get_store()
    if store is not None:
        # Written last: a process that finds it finds everything the compile stored before it.
        store.flush(timeout=FLUSH_TIMEOUT_S)
        store.put("background_compile", key, seconds.encode())
    if store is None or not store.flush(timeout=FLUSH_TIMEOUT_S):
        print("warmstart compile worker: the store did not take every entry", file=sys.stderr)
        return 3
    (job_path.parent / f"{key}.done").write_text(seconds + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
