"""Two ranks over gloo under torchrun: the cached plan across ranks and machines, the start-up graph,
and a stage failing on one rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
pytestmark = pytest.mark.slow


def _torchrun(mode: str, out: Path, *args: str, cache_dir: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "WARMSTART_CACHE_DIR": str(cache_dir),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "LOCAL_WORLD_SIZE": "2",
    }
    return subprocess.run(
        [
            str(TORCHRUN),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(HERE / "_torchrun_worker.py"),
            mode,
            str(out),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE,
    )


def _ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_cached_plan_over_two_ranks_then_a_new_machine_hits_the_shared_cache(tmp_path, fresh_machine, redis_node):
    secret = "torchrun-plan-test"
    cold = _torchrun("plan", tmp_path / "cold", redis_node.url, secret, cache_dir=tmp_path / "machine-a")
    assert cold.returncode == 0, cold.stdout[-3000:] + cold.stderr[-3000:]
    warm = _torchrun("plan", tmp_path / "warm", redis_node.url, secret, cache_dir=tmp_path / "machine-b")
    assert warm.returncode == 0, warm.stdout[-3000:] + warm.stderr[-3000:]
    (cold0, cold1), (warm0, warm1) = _ranks(tmp_path / "cold"), _ranks(tmp_path / "warm")
    for rank in (cold0, cold1, warm0, warm1):
        assert rank["equal_to_collective_plan"] is True
        assert len(rank["losses"]) == 3 and all(loss == loss for loss in rank["losses"])  # finite, trained
        assert rank["tables_changed"] == rank["tables_local"] > 0  # fused optimizer updated the shards
        assert rank["gloo_threads_at_exit"] == 0  # every process group freed before exit (see below)
    # Only rank 0 looks up or plans; on the new machine it plans nothing and reads the shared Redis.
    assert (cold0["planner_calls"], cold1["planner_calls"]) == (1, 0)
    assert (warm0["planner_calls"], warm1["planner_calls"]) == (0, 0)
    assert cold1["store_lookups"] == warm1["store_lookups"] == 0
    assert warm0["hits"].get("remote") == 1


# Each worker ends with release_process_groups(), and its JSON says how many gloo worker threads
# were still running after it: 0, i.e. no process group outlives the job into interpreter exit.
# Before, the DistributedModelParallel kept the group alive past destroy_process_group(); a gloo
# thread that was still freeing the last collectives' tensors when the interpreter finalized took the
# GIL, CPython ended it with pthread_exit, and its unwinding through the noexcept ~AsyncWork aborted
# the rank (SIGABRT, 'terminate called without an active exception') on loaded machines.


def test_startup_graph_builds_a_trainable_torchrec_job(tmp_path, fresh_machine):
    proc = _torchrun("graph", tmp_path / "out", cache_dir=tmp_path / "cache")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path / "out")
    stages = [
        "checkpoint_load",
        "compile_warmup",
        "data_loader_init",
        "data_loader_start",
        "first_batch_ready",
        "model_meta",
        "model_transform",
        "optimizer_init",
        "process_group_init",
        "sharding_plan",
        "sharding_plan_broadcast",
    ]
    assert rank0["stages"] == rank1["stages"] == stages
    # Rank 0 planned in a forked child (so its own counter stays 0); rank 1 never planned.
    assert rank0["plan_source"] == "planner" and rank1["plan_source"] is None
    assert rank1["planner_calls"] == 0
    assert rank0["plan"] == rank1["plan"]
    assert rank0["checkpoint_load"] == rank1["checkpoint_load"] > 0
    # rank 0's loader fetched its first batches in its worker during start-up; rank 1's makes them in
    # its own process (a random transform), so it fetched none ahead: its first came after the load
    assert rank0["prefetched"] == 3
    assert rank1["prefetched"] == 0 and rank1["first_draw_after_the_load"]
    for rank in (rank0, rank1):
        assert rank["compile_s"] > 0
        assert len(rank["losses"]) == 2 and rank["tables_changed"] == rank["tables_local"] > 0
        assert rank["gloo_threads_at_exit"] == 0


@pytest.mark.parametrize(
    "mode", ["fail", "fail-peer-waiting"], ids=["peer-in-a-collective", "peer-outside-collectives"]
)
def test_a_stage_failing_on_one_rank_fails_every_rank_naming_it(tmp_path, fresh_machine, mode):
    """The failing rank's own error comes out (its launcher kills the others once one rank exits),
    and each rank names the stage, whether the peer that hears of it is stuck in a collective (it is
    aborted) or only waiting (it raises the failure)."""
    # timeout: a hang guard, not a speed check.
    proc = _torchrun(mode, tmp_path / "out", cache_dir=tmp_path / "cache", timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    # Nobody waited out the 60 s collective timeout (gloo: "Timed out waiting 60000ms for recv ...").
    assert re.search(r"Timed out waiting \d+ms", output) is None, output[-4000:]
    assert "start-up stage 'data_loader_init' failed on rank 1: OSError: data loader worker died" in output
    failing = json.loads((tmp_path / "out" / "rank1.json").read_text())  # rank 1 raised StageFailed
    assert (failing["stage"], failing["failed_rank"]) == ("data_loader_init", 1)
    # Rank 0 sat in a collective that rank 1 never joined: it names the same stage before it goes.
    assert "start-up stage 'data_loader_init' failed on rank 1 (seen on rank 0)" in output, output[-4000:]
