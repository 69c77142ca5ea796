"""torchrun worker for test_torchrun_restart: rank 1 dies on attempt 0; on attempt 1 rank 0 starts late."""

import datetime
import os
import signal
import time

import torch
import torch.distributed as dist

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 0:
    time.sleep(4)  # e.g. a slow import or a slow node: rank 1 reaches init_process_group first
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
t = torch.ones(1)
dist.all_reduce(t)
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
print(f"attempt {attempt} rank {rank} ok", flush=True)
dist.destroy_process_group()
