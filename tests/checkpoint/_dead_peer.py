"""One rank of ``test_dead_peer.py``: ``_dead_peer.py RANK PORT OUT CKPT_DIR HOW COMMIT_TIMEOUT_S``.

Two ranks over gloo, started as plain processes (no launcher to tear rank 0 down when rank 1 dies,
as a rank on another machine would see it). Step 0 is saved and committed by both ranks; during the
background write of step 1, after staging and before its commit, rank 1 is lost:

    kill   rank 1 SIGKILLs itself (its connections close). Rank 0 calls ``close()``, which must
           return with the save reported as not committed.
    stop   rank 1 SIGSTOPs itself: a hung or partitioned machine, no connection is closed, so only
           the timeout can tell. Rank 0 leaves without ``close()``: interpreter exit must not wait
           for gloo's 30 minutes.

Rank 0 writes ``OUT/report.json``; its ETT events go to ``WARMSTART_RUN_DIR``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from warmstart.checkpoint import Checkpointer, RankLocal
from warmstart.init_pipeline import release_process_groups
from warmstart.metrics import get_recorder


class Tripwire:
    """A rank-local entry that sends its process ``signum`` when DCP serializes it: inside the
    background write, after staging (which copies it without firing) and before the commit."""

    def __init__(self, signum: int = 0) -> None:
        self.signum = signum

    def __deepcopy__(self, memo: dict) -> Tripwire:
        return Tripwire(self.signum)

    def __reduce__(self) -> tuple:
        if self.signum:
            os.kill(os.getpid(), self.signum)
        return (Tripwire, (0,))


def main() -> None:
    rank, port, out, ckpt_dir, how, timeout_s = sys.argv[1:7]
    rank = int(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rec = get_recorder()
    rec.attempt_start()
    wire = Tripwire()
    state = {"t": RankLocal({"t": torch.arange(4096, dtype=torch.float32) + rank}), "wire": RankLocal({"wire": wire})}
    ckpt = Checkpointer(ckpt_dir, mode="async-thread", on_error="continue", commit_timeout_s=float(timeout_s))
    ckpt.save(0, state, block=True)  # both ranks alive: committed
    if rank == 1:
        wire.signum = signal.SIGKILL if how == "kill" else signal.SIGSTOP
    ckpt.save(1, state)  # returns once staged; rank 1 is lost in its background write
    if rank == 1:
        time.sleep(120)  # never ends: killed, or stopped until the test kills it
    report: dict = {"staged_at": time.time()}
    if how == "kill":
        start = time.monotonic()
        ckpt.close()
        report.update(
            close_s=time.monotonic() - start, failures=ckpt.failures, last_committed_step=ckpt.last_committed_step
        )
        # close() freed the checkpointer's own group; with the default one gone too, no gloo thread is left.
        report["gloo_threads_at_exit"] = release_process_groups()
    Path(out, "report.json").write_text(json.dumps(report))
    # "stop": no close(); interpreter exit waits for the commit (bounded), then frees the group.


if __name__ == "__main__":
    main()
