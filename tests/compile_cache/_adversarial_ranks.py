"""Rank-dependent adversarial cases, run under ``torchrun`` with gloo: functions whose compiled frames
read ``torch.distributed`` state that Dynamo folds into constants. Every rank compiles each case,
compares it with eager PyTorch and prints one JSON line (see ``_adversarial_job.py``).

``ADVERSARIAL_BEFORE_INIT=1`` compiles the ``is_initialized`` case before the process group exists.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from _adversarial_cases import CASES, Case, _x, case
from _adversarial_job import run_case


def times_rank(x):
    return x * (dist.get_rank() + 1)


def times_world(x):
    return x * dist.get_world_size()


def initialized(x):
    return x * (2.0 if dist.is_initialized() else 3.0)


def my_rows(x):
    rows = x.shape[0] // dist.get_world_size()
    rank = dist.get_rank()
    return x[rank * rows : (rank + 1) * rows] * 2.0


def rank0_branch(x):
    if dist.get_rank() == 0:
        return x + 1.0
    return x - 1.0


RANK_CASES = {
    "get_rank": times_rank,
    "get_world_size": times_world,
    "is_initialized": initialized,
    "rank_shard": my_rows,
    "rank0_branch": rank0_branch,
}
for _name, _function in RANK_CASES.items():
    case(_name, "torch.distributed")(lambda cond, f=_function: Case(f, (torch.ones(4, 4) if f is my_rows else _x(),)))


def main() -> None:
    results = {}
    if os.environ.get("ADVERSARIAL_BEFORE_INIT") == "1":
        results["is_initialized"] = run_case("is_initialized", "x")
    dist.init_process_group("gloo")
    for name in RANK_CASES:
        if name not in results:
            results[name] = run_case(name, "x")
    from warmstart.compile_cache import get_store

    store = get_store()
    if store is not None:
        store.flush(timeout=60)
    dist.barrier()
    # One file a rank: ranks printing at once after the barrier share torchrun's stdout pipe, and a
    # line longer than PIPE_BUF from each may interleave.
    Path(os.environ["ADVERSARIAL_RESULTS"], f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    assert set(RANK_CASES) <= set(CASES)
    main()
