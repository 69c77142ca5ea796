"""End to end under torchrun (2 ranks, gloo, TorchRec): a rank SIGKILLed in the middle of an async
save, a restart that resumes from the previous committed checkpoint and reaches bit-identical
parameters, and a checkpoint volume that fills up half-way through training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _results import final_state
from torch.distributed.checkpoint import FileSystemReader

from warmstart.checkpoint import committed_checkpoints, latest_committed
from warmstart.metrics import read_events

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).with_name("_train.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS, SAVE_EVERY, KILL_AT = 12, 3, 8  # saves after steps 2, 5, 8, 11; the write of step 8 is killed


def torchrun(
    out: Path, ckpt_dir: Path, *args: str, restarts: int = 0, preexec: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        WARMSTART_RUN_DIR=str(out / "events"),
        WARMSTART_JOB_ID="ckpt-test",
        # torchrun shares its rendezvous TCPStore with the workers; after a restart a late rank 0
        # can be sent its previous attempt's gloo address (pytorch/pytorch#135712; see
        # test_torchrun_restart.py).
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        str(TRAIN),
        "--dir",
        str(ckpt_dir),
        "--out",
        str(out),
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, preexec_fn=preexec)


def reports(out: Path) -> dict[tuple[int, int], dict]:
    return {(r["rank"], r["attempt"]): r for r in (json.loads(p.read_text()) for p in out.glob("report-*.json"))}


def committed_events(out: Path) -> dict[int, list[int]]:
    """attempt -> steps recorded as checkpoint_committed by rank 0."""
    found: dict[int, list[int]] = {}
    for path in (out / "events").glob("events-r0-a*.jsonl"):
        for event in read_events(path):
            if event.event == "checkpoint_committed":
                found.setdefault(event.attempt, []).append(event.step)  # type: ignore[arg-type]
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run (process-based async saves) to compare against."""
    out = tmp_path_factory.mktemp("reference")
    done = torchrun(
        out, out / "ckpt", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--mode", "async-process"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.mark.parametrize("kill_rank", [1, 0], ids=["kill-rank1", "kill-rank0-coordinator"])
def test_sigkill_mid_async_save_resumes_from_previous_commit(reference: Path, tmp_path: Path, kill_rank: int) -> None:
    ckpt_dir = tmp_path / "ckpt"
    # The killed rank dies inside the background write (see _train.Tripwire), after its data file is
    # opened and before it reports the write to the coordinator: deterministic, no timing involved.
    done = torchrun(
        tmp_path,
        ckpt_dir,
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        "--mode",
        "async-thread",
        "--kill-rank",
        str(kill_rank),
        "--kill-at",
        str(KILL_AT),
        restarts=1,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "exitcode: -9" in done.stderr  # the rank really died of SIGKILL
    rep = reports(tmp_path)
    for rank in (0, 1):
        second = rep[(rank, 1)]
        # Resumed from step 5, the last commit before the killed save of step 8, never from 8.
        assert second["resumed"] == KILL_AT - SAVE_EVERY
        assert second["saved"] == [8, 11] and second["committed"] == 11 and second["position"] == STEPS
    if kill_rank == 0:
        # Nobody was left to clean up: the partial folder of step 8 was there at the restart, and ignored.
        assert any(
            name.startswith("step_000000008.") and name.endswith(".partial") for name in rep[(0, 1)]["seen_at_start"]
        )
    assert [c.step for c in committed_checkpoints(ckpt_dir)] == [8, 11]
    assert not list(ckpt_dir.glob("*.partial"))
    events = committed_events(tmp_path)
    # attempt 1's first: the checkpoint it loaded, recorded before its first step
    assert KILL_AT not in events.get(0, []) and events[1] == [KILL_AT - SAVE_EVERY, 8, 11]

    for rank in (0, 1):
        resumed, uninterrupted = final_state(tmp_path, rank), final_state(reference, rank)
        assert resumed.keys() == uninterrupted.keys()
        assert any("ebc" in key and "momentum1" in key for key in resumed)  # fused optimizer state compared too
        for key, tensor in uninterrupted.items():
            assert torch.equal(resumed[key], tensor), f"rank {rank}: {key} differs after resumption"


@pytest.mark.parametrize("on_error", ["continue", "raise"])
def test_full_volume(full_disk, tmp_path: Path, on_error: str) -> None:
    # Step 2's checkpoint is small; from step 3 on each rank holds 4 MiB more: nothing after fits.
    done = torchrun(
        tmp_path / "out",
        full_disk.path,
        "--steps",
        "9",
        "--save-every",
        str(SAVE_EVERY),
        "--keep",
        "1",
        "--on-error",
        on_error,
        "--ballast-kb-after",
        "3",
        "4096",
        preexec=full_disk.preexec(),
    )
    where = f"checkpoint of step 5 was not saved in {full_disk.path}: {full_disk.errno_text}"
    lines = [line for line in done.stderr.splitlines() if "was not saved in" in line]
    if on_error == "continue":
        assert done.returncode == 0, done.stderr[-4000:]
        assert len(lines) == 1 and where in lines[0], lines  # one line for the whole job, not per save or rank
        assert "latest committed: step 2" in lines[0] and "training continues" in lines[0]
        rep = reports(tmp_path / "out")
        assert all(rep[(rank, 0)]["failures"] == 2 and rep[(rank, 0)]["position"] == 9 for rank in (0, 1))
    else:
        assert done.returncode != 0
        # Every rank stops with the same one-line error (torchrun prefixes each line with "[rankN]: ").
        for rank in (0, 1):
            assert any(
                line.startswith(f"[rank{rank}]: warmstart.checkpoint.checkpointer.CheckpointError: {where}")
                for line in lines
            ), lines
    latest = latest_committed(full_disk.path)
    assert latest is not None and latest.step == 2 and [c.step for c in committed_checkpoints(full_disk.path)] == [2]
    assert FileSystemReader(latest.path).read_metadata().state_dict_metadata  # the earlier checkpoint is readable
    assert not list(full_disk.path.glob("*.partial"))
