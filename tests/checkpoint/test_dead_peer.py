"""A peer lost while a save commits: 2 ranks over gloo as plain processes (see ``_dead_peer.py``).

Rank 1 is SIGKILLed (its connections close) or SIGSTOPped (a hung machine: nothing closes, only the
timeout can tell) in the background write of step 1, after staging, before the commit. Rank 0 must
exit cleanly within ``commit_timeout_s`` + 15 s, report step 1 as not saved, and record
``checkpoint_committed`` for step 0 only. Before, the commit's collectives waited for gloo's default
timeout (30 min) on a ThreadPoolExecutor thread that interpreter exit joins without a bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _redis import free_port

from warmstart.checkpoint import latest_committed
from warmstart.metrics import read_events

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_dead_peer.py")
COMMIT_TIMEOUT_S = 5.0
BOUND_S = COMMIT_TIMEOUT_S + 15


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_rank0_exits_within_the_commit_timeout_when_its_peer_is_lost(tmp_path: Path, how: str) -> None:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        WARMSTART_RUN_DIR=str(tmp_path / "events"),
        WARMSTART_JOB_ID="dead-peer",
        PYTHONWARNINGS="ignore",
    )
    env.pop("WARMSTART", None)
    port, ckpt_dir = str(free_port()), tmp_path / "ckpt"
    procs = []
    for rank in (0, 1):
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    str(rank),
                    port,
                    str(tmp_path),
                    str(ckpt_dir),
                    how,
                    str(COMMIT_TIMEOUT_S),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    rank0, rank1 = procs
    try:
        deadline = time.monotonic() + 120  # start-up (torch imports) and the first, committed save
        while not (rank1.poll() is not None if how == "kill" else _stopped(rank1.pid)):
            assert time.monotonic() < deadline, (tmp_path / "rank1.log").read_text()[-3000:]
            assert rank0.poll() is None, (tmp_path / "rank0.log").read_text()[-3000:]
            time.sleep(0.05)
        try:  # hang guard, not a speed check: before, rank 0 waited out gloo's 30 min default timeout
            rank0.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"rank 0 still running {BOUND_S:g} s after rank 1 was lost:\n"
                + (tmp_path / "rank0.log").read_text()[-3000:]
            )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    output = (tmp_path / "rank0.log").read_text()
    assert rank0.returncode == 0, output[-3000:]
    if how == "kill":
        assert rank1.returncode == -signal.SIGKILL  # the peer really died in its write
    assert "terminate called" not in output
    # One warning names the save that was lost and why; rank 1 never answered.
    lines = [line for line in output.splitlines() if "checkpoint of step 1 was not saved in" in line]
    assert len(lines) == 1, output[-3000:]
    assert "latest committed: step 0" in lines[0]
    report = json.loads((tmp_path / "report.json").read_text())
    if how == "kill":
        assert report["failures"] == 1 and report["last_committed_step"] == 0
        assert report["gloo_threads_at_exit"] == 0  # close() destroyed and let go of its own gloo group
    committed = [
        e.step
        for path in (tmp_path / "events").glob("events-r0-a*.jsonl")
        for e in read_events(path)
        if e.event == "checkpoint_committed"
    ]
    assert committed == [0]
    found = latest_committed(ckpt_dir)
    assert found is not None and found.step == 0
    assert not list(ckpt_dir.glob("*.partial"))  # rank 0 discarded the half-written step 1
