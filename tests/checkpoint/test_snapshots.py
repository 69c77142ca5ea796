"""Per-step snapshots end to end under torchrun (2 ranks, gloo, TorchRec): the ranks of attempt 0 die
between two checkpoints, and the restart resumes from the last step they finished (from the node's
keeper, or from the buddy's when the node is gone), reaching the parameters of an uninterrupted run
bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _results import final_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).with_name("_train.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS, SAVE_EVERY, DIE_AT = 12, 3, 10  # saves after steps 2, 5, 8, 11; attempt 0 dies before step 10
SECRET = "snapshot-test-secret"


def torchrun(out: Path, ckpt_dir: Path, *args: str, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        WARMSTART_SECRET=SECRET,
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # see test_torchrun_restart.py
    )
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts), str(TRAIN)]
    cmd += ["--dir", str(ckpt_dir), "--out", str(out), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def reports(out: Path) -> dict[tuple[int, int], dict]:
    return {(r["rank"], r["attempt"]): r for r in (json.loads(p.read_text()) for p in out.glob("report-*.json"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    done = torchrun(out, out / "ckpt")
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for the keeper's socket (AF_UNIX paths: 107 bytes at most); the keepers the
    test started are stopped with it."""
    path = Path(tempfile.mkdtemp(prefix="ws-keeper-", dir="/tmp"))
    yield path
    # every keeper the test started names the directory on its command line (stopped ones too)
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path).encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours
            continue
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    ("die_at", "every", "overlap", "kept"),
    [(DIE_AT, 1, False, DIE_AT - 1), (2, 1, False, 1), (9, 2, False, 7), (8, 1, True, 6)],
    ids=["after-checkpoints", "before-any-checkpoint", "every-2-steps", "copies-overlapping-the-next-step"],
)
def test_a_restart_resumes_from_the_last_step_its_ranks_finished(
    reference: Path, tmp_path: Path, socket_dir: Path, die_at: int, every: int, overlap: bool, kept: int
):
    """Before any checkpoint, the first snapshot holds every row and the dense optimizer has not
    stepped yet in the restart (TorchRec's lazy state): restored all the same. With a snapshot every
    2 steps, the one after step 7 carries step 6's rows too, and step 8 is lost. With the copies
    overlapping the next step, each made to take 0.3 s, and a death before step 8 that does not wait
    for step 7's copy: the restart resumes from step 6's snapshot, whose copy overlapped step 7. Step
    7's table update and dense optimizer step waited for it, or the restored state would hold values
    of step 7."""
    keeper = f"unix:{socket_dir / 'node.sock'}"
    args = ["--keeper", keeper, "--die-at", str(die_at), "--snapshot-every", str(every)]
    args += ["--overlap", "--slow-copies"] * overlap
    done = torchrun(tmp_path, tmp_path / "ckpt", *args, restarts=1)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "exitcode: 17" in done.stderr  # attempt 0 really died
    rep = reports(tmp_path)
    for rank in (0, 1):
        assert rep[(rank, 1)]["snapshot"] == [kept, "keeper"]
        assert rep[(rank, 1)]["resumed"] == kept
        assert rep[(rank, 0)]["overlap"] is overlap
        # the training thread's waits for the slowed copies are counted (without overlap: none)
        assert (rep[(rank, 1)]["snapshot_stats"]["wait_s"] > 0) is overlap
    for rank in (0, 1):
        resumed, uninterrupted = final_state(tmp_path, rank), final_state(reference, rank)
        assert resumed.keys() == uninterrupted.keys()
        for key, tensor in uninterrupted.items():
            assert torch.equal(resumed[key], tensor), f"rank {rank}: {key} differs after resumption"


@pytest.fixture
def buddy(socket_dir: Path) -> Iterator[str]:
    """Another node's keeper, on TCP."""
    ready = socket_dir / "buddy.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmstart.checkpoint.keeper", "--listen", "127.0.0.1:0", "--ready-file", str(ready)],
        env={**os.environ, "WARMSTART_SECRET": SECRET},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "no address in 30 s"
        yield ready.read_text().split()[0]
    finally:
        proc.kill()
        proc.wait()


def test_a_restart_on_a_new_node_resumes_from_the_buddy(reference: Path, tmp_path: Path, socket_dir: Path, buddy: str):
    """Attempt 0's node is lost (its keeper killed, its socket gone); attempt 1 runs on a new node
    whose keeper is empty, and resumes from the copy its old keeper streamed to the buddy."""
    keeper = f"unix:{socket_dir / 'node-{attempt}.sock'}"
    args = ["--keeper", keeper, "--buddy", buddy, "--buddy-restore", buddy, "--die-at", str(DIE_AT), "--lose-node"]
    done = torchrun(tmp_path, tmp_path / "ckpt", *args, restarts=1)
    assert done.returncode == 0, done.stderr[-4000:]
    rep = reports(tmp_path)
    for rank in (0, 1):
        assert rep[(rank, 1)]["snapshot"] == [DIE_AT - 1, "buddy"]
    for rank in (0, 1):
        resumed, uninterrupted = final_state(tmp_path, rank), final_state(reference, rank)
        for key, tensor in uninterrupted.items():
            assert torch.equal(resumed[key], tensor), f"rank {rank}: {key} differs after resumption"


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_keeper_killed_or_stopped_mid_run_costs_the_job_nothing_but_snapshots(
    reference: Path, tmp_path: Path, socket_dir: Path, fault: str
):
    """The node's keeper dies (SIGKILL) or hangs (SIGSTOP) after step 4: training goes on at full
    speed with one warning per rank, and the restart after the ranks die resumes from the
    checkpoint, as without snapshots."""
    keeper = f"unix:{socket_dir / 'node.sock'}"
    args = ["--keeper", keeper, "--keeper-fault", fault, "--keeper-fault-at", "4", "--die-at", str(DIE_AT)]
    done = torchrun(tmp_path, tmp_path / "ckpt", *args, restarts=1)
    assert done.returncode == 0, done.stderr[-4000:]
    rep = reports(tmp_path)
    for rank in (0, 1):
        assert rep[(rank, 1)]["snapshot"] is None  # attempt 1's keeper is a new, empty one
        assert rep[(rank, 1)]["resumed"] in (5, 8)  # the last committed checkpoint when the ranks died
    lost = [line for line in done.stderr.splitlines() if "per-step snapshots not kept" in line]
    assert len(lost) == 2, lost  # once per rank of attempt 0
    for rank in (0, 1):
        resumed, uninterrupted = final_state(tmp_path, rank), final_state(reference, rank)
        for key, tensor in uninterrupted.items():
            assert torch.equal(resumed[key], tensor), f"rank {rank}: {key} differs after resumption"
