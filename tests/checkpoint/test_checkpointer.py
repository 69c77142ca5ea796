"""The checkpointer in one process: round trips, bit-identical resumption, keep-N, events, the error
policy on real full and read-only file systems, and bad settings."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from warmstart.checkpoint import (
    AdaptiveInterval,
    AsyncMode,
    Checkpointer,
    CheckpointError,
    OptimizerState,
    RankLocal,
    committed_checkpoints,
    latest_committed,
    optimal_interval_s,
)
from warmstart.errors import ConfigError
from warmstart.metrics import NullRecorder, Recorder, read_events

MODES = [AsyncMode.SYNC, AsyncMode.ASYNC]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Counter:
    """A data-loader-like object: its position is the state to keep."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Counter, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = Counter()
    state = {"model": model, "optim": OptimizerState(model, optimizer), "loader": RankLocal(loader)}
    return model, optimizer, loader, state


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Counter) -> None:
    # Data from the loader position, noise from all three global RNGs, dropout from torch's.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(loader.position))
    target = x.sum(1, keepdim=True) + random.random() + float(np.random.rand()) + torch.rand(1)
    loss = torch.nn.functional.mse_loss(model(x), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loader.position += 1


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_resume_is_bit_identical(tmp_path: Path, mode: AsyncMode) -> None:
    model, optimizer, loader, state = _setup()
    _seed_all(1)
    with Checkpointer(tmp_path, mode=mode, keep=2, recorder=NullRecorder()) as ckpt:
        for step in range(8):
            _step(model, optimizer, loader)
            if step in (2, 5):
                ckpt.save(step, state)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, optimizer2, loader2, state2 = _setup(seed=99)  # different weights, fresh optimizer
    _seed_all(42)  # different RNG streams: the checkpoint must restore them
    with Checkpointer(tmp_path, mode=mode, recorder=NullRecorder()) as ckpt:
        assert ckpt.load_latest(state2) == 5
        assert loader2.position == 6
        for _step_no in range(6, 8):
            _step(model2, optimizer2, loader2)
    for key, value in model2.state_dict().items():
        assert torch.equal(value, reference[key]), key
    assert optimizer2.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


def test_keep_prunes_and_plain_entries_are_replaced(tmp_path: Path) -> None:
    state = {"extra": {"t": torch.zeros(3)}}
    with Checkpointer(tmp_path, mode="async-thread", keep=2, save_rng=False, recorder=NullRecorder()) as ckpt:
        for step in range(5):
            state["extra"] = {"t": torch.full((3,), float(step))}
            ckpt.save(step, state)
    assert [c.step for c in committed_checkpoints(tmp_path)] == [3, 4]
    target = {"extra": {"t": torch.zeros(3)}}
    assert Checkpointer(tmp_path, recorder=NullRecorder(), save_rng=False).load_latest(target) == 4
    assert torch.equal(target["extra"]["t"], torch.full((3,), 4.0))


def test_rng_is_optional_on_either_side(tmp_path: Path) -> None:
    model, optimizer, loader, state = _setup()
    Checkpointer(tmp_path / "without", mode="sync", save_rng=False, recorder=NullRecorder()).save(0, state)
    Checkpointer(tmp_path / "with", mode="sync", recorder=NullRecorder()).save(0, state)
    _seed_all(5)
    expected = torch.rand(3)
    target = _setup()[3]
    _seed_all(5)
    assert Checkpointer(tmp_path / "without", recorder=NullRecorder()).load_latest(target) == 0
    assert torch.equal(torch.rand(3), expected)  # nothing to restore: the generators are left alone
    assert Checkpointer(tmp_path / "with", save_rng=False, recorder=NullRecorder()).load_latest(_setup()[3]) == 0


def test_no_checkpoint_means_fresh_start(tmp_path: Path) -> None:
    model, _, _, state = _setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert Checkpointer(tmp_path / "new", recorder=NullRecorder()).load_latest(state) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_events_blocking_span_and_commit_only_when_durable(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "run", job="j", rank=0, attempt=0, flush_interval_s=0)
    model, optimizer, loader, state = _setup()
    ckpt = Checkpointer(tmp_path / "ckpt", mode=AsyncMode.ASYNC, recorder=rec)
    rec.attempt_start()
    _step(model, optimizer, loader)
    ckpt.save(0, state)
    ckpt.wait()
    assert ckpt.last_committed_step == 0 and latest_committed(tmp_path / "ckpt").step == 0  # type: ignore[union-attr]
    ckpt.save(1, state, block=True)
    ckpt.close()
    rec.close()
    events = [e for path in sorted((tmp_path / "run").glob("*.jsonl")) for e in read_events(path)]
    kinds = [(e.event, getattr(e, "span", None) or getattr(e, "step", None)) for e in events]
    assert kinds.count(("begin", "checkpoint_save")) == 2 and kinds.count(("end", "checkpoint_save")) == 2
    committed = [e.step for e in events if e.event == "checkpoint_committed"]
    assert committed == [0, 1]


def test_load_latest_records_the_loaded_checkpoint_as_committed(tmp_path: Path) -> None:
    model, optimizer, loader, state = _setup()
    with Checkpointer(tmp_path / "ckpt", recorder=NullRecorder()) as ckpt:
        _step(model, optimizer, loader)
        ckpt.save(3, state, block=True)
    rec = Recorder(tmp_path / "run", job="j", rank=0, attempt=1, flush_interval_s=0)
    with Checkpointer(tmp_path / "ckpt", recorder=rec) as ckpt:
        assert ckpt.load_latest(_setup()[3]) == 3
    rec.close()
    events = [e for path in sorted((tmp_path / "run").glob("*.jsonl")) for e in read_events(path)]
    # the restart vouches for a commit whose own event a failure may have cut off
    assert [(e.event, getattr(e, "span", None) or getattr(e, "step", None)) for e in events] == [
        ("begin", "checkpoint_load"),
        ("end", "checkpoint_load"),
        ("checkpoint_committed", 3),
    ]


def test_plain_optimizer_is_refused(tmp_path: Path) -> None:
    model, optimizer, _, _ = _setup()
    with pytest.raises(TypeError, match="OptimizerState"):
        Checkpointer(tmp_path, recorder=NullRecorder()).save(0, {"optim": optimizer})


@pytest.mark.parametrize(
    "kwargs, variable",
    [
        ({"mode": "fast"}, "mode"),
        ({"keep": 0}, "keep"),
        ({"on_error": "ignore"}, "on_error"),
        ({"commit_timeout_s": 0}, "commit_timeout_s"),
        ({"commit_timeout_s": float("inf")}, "commit_timeout_s"),
        ({"commit_timeout_s": "60"}, "commit_timeout_s"),
    ],
)
def test_bad_settings(tmp_path: Path, kwargs: dict, variable: str) -> None:
    with pytest.raises(ConfigError, match=variable) as info:
        Checkpointer(tmp_path, recorder=NullRecorder(), **kwargs)
    assert "\n" not in str(info.value)


def test_unusable_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"file/ckpt is not usable: Not a directory \(errno 20\)"):
        Checkpointer(blocker / "ckpt", recorder=NullRecorder())
    with caplog.at_level(logging.WARNING, logger="warmstart.checkpoint"):
        ckpt = Checkpointer(blocker / "ckpt", recorder=NullRecorder(), on_error="continue", mode="sync")
        ckpt.save(0, {"t": {"x": torch.ones(2)}})
        ckpt.save(1, {"t": {"x": torch.ones(2)}})
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("warmstart.checkpoint")]
    assert len(lines) == 2 and "not usable" in lines[0] and "checkpoint of step 0" in lines[1]
    assert ckpt.failures == 3


def test_read_only_directory_keeps_earlier_checkpoints(read_only_dir: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        Checkpointer(read_only_dir / "ckpt", recorder=NullRecorder())
    message = str(info.value)
    assert str(read_only_dir / "ckpt") in message and "errno" in message and "\n" not in message


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_full_disk_raise_or_continue(full_disk, mode: AsyncMode, caplog: pytest.LogCaptureFixture) -> None:
    if full_disk.kind != "tmpfs":
        pytest.skip("needs a mountable tmpfs in-process; test_recovery covers the file-size-limit variant")
    small = {"t": {"x": torch.ones(1024)}}  # 4 KiB
    big = {"t": {"x": torch.ones(1024 * 1024)}}  # 4 MiB: more than the volume holds
    ckpt = Checkpointer(full_disk.path, mode=mode, keep=3, recorder=NullRecorder(), save_rng=False)
    ckpt.save(0, small, block=True)
    with pytest.raises(CheckpointError) as info:
        ckpt.save(1, big, block=True)
    message = str(info.value)
    assert "\n" not in message and str(full_disk.path) in message and full_disk.errno_text in message
    assert "latest committed: step 0" in message
    assert [c.step for c in committed_checkpoints(full_disk.path)] == [0]
    assert not list(full_disk.path.glob("*.partial"))  # the failed write's space is given back
    ckpt.close()

    ckpt = Checkpointer(full_disk.path, mode=mode, recorder=NullRecorder(), save_rng=False, on_error="continue")
    with caplog.at_level(logging.WARNING, logger="warmstart.checkpoint"):
        for step in (2, 3):
            ckpt.save(step, big)
        ckpt.save(4, small)
        ckpt.close()
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("warmstart.checkpoint")]
    assert len(warnings) == 1 and "checkpoint of step 2" in warnings[0], warnings  # logged once
    assert ckpt.failures == 2
    assert [c.step for c in committed_checkpoints(full_disk.path)] == [0, 4]
    loaded = {"t": {"x": torch.zeros(1024)}}
    assert Checkpointer(full_disk.path, recorder=NullRecorder(), save_rng=False).load_latest(loaded) == 4
    assert torch.equal(loaded["t"]["x"], torch.ones(1024))


def test_adaptive_interval_follows_young_formula(tmp_path: Path) -> None:
    policy = AdaptiveInterval(mtbf_s=3600.0, first_steps=5)
    assert policy.next_step(0, now_s=100.0, blocking_s=None) == 5
    # 10 steps in 20 s (2 s/step), 0.5 s blocking: sqrt(2 * 3600 * 0.5) = 60 s = 30 steps.
    assert policy.next_step(10, now_s=120.0, blocking_s=0.5) == 40
    assert AdaptiveInterval.from_failures_per_day(24.0).mtbf_s == 3600.0
    for mtbf_s in (0.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            AdaptiveInterval(mtbf_s=mtbf_s)
    for failures_per_day in (0.0, float("inf")):
        with pytest.raises(ConfigError, match=r"failures_per_day=.* is not valid: expected a positive, finite number"):
            AdaptiveInterval.from_failures_per_day(failures_per_day)
    # sqrt(2 * 3600 * 0.5) = 60 s; nothing blocks: no interval to trade against
    assert optimal_interval_s(0.5, mtbf_s=3600.0) == pytest.approx(60.0)
    assert optimal_interval_s(0.0, mtbf_s=3600.0) == 0.0
    for mtbf_s in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"mtbf_s=.* is not valid: expected a positive number of seconds"):
            optimal_interval_s(0.5, mtbf_s=mtbf_s)

    ckpt = Checkpointer(
        tmp_path,
        mode="sync",
        recorder=NullRecorder(),
        save_rng=False,
        interval=AdaptiveInterval(mtbf_s=3600.0, first_steps=3, max_steps=4),
    )
    saved = [step for step in range(12) if ckpt.maybe_save(step, {"t": {"x": torch.ones(2)}})]
    ckpt.close()
    # 3 steps to the first save and 3 more (its blocking time is not known yet when the next save
    # is planned, at its start); then the formula asks for far more than max_steps=4 (ms-long steps).
    assert saved == [3, 6, 10]
    assert json.loads((latest_committed(tmp_path).path / "COMMITTED").read_text())["step"] == 10  # type: ignore[union-attr]


def test_async_save_that_cannot_start_fails_on_the_next_call(tmp_path: Path) -> None:
    # dcp.async_save runs on the commit thread: a state it cannot save (a lock cannot be copied) does
    # not raise in save(), it fails the save; wait() reports it, nothing is committed, the commit
    # thread ends, and the next save works.
    ckpt = Checkpointer(tmp_path, mode=AsyncMode.ASYNC, recorder=NullRecorder(), save_rng=False)
    ckpt.save(0, {"t": {"x": torch.ones(2), "lock": threading.Lock()}})
    ckpt.wait_staged()  # returns: the copy is over (it failed)
    with pytest.raises(CheckpointError, match="checkpoint of step 0"):
        ckpt.wait()
    assert committed_checkpoints(tmp_path) == [] and not list(tmp_path.glob("*.partial"))
    assert ckpt._join_commit(10)  # the commit thread has ended
    ckpt.save(1, {"t": {"x": torch.ones(2)}}, block=True)
    assert [c.step for c in committed_checkpoints(tmp_path)] == [1]
    ckpt.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_single_process_checkpointer_silences_dcp_and_restores_the_filters(tmp_path: Path, mode: AsyncMode) -> None:
    model, optimizer, loader, state = _setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        with Checkpointer(tmp_path, mode=mode, keep=1, recorder=NullRecorder()) as ckpt:
            ckpt.save(0, state)
        with Checkpointer(tmp_path, mode=mode, keep=1, recorder=NullRecorder()) as ckpt:
            assert ckpt.load_latest(state) == 0
        assert warnings.filters == before
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]


def test_importing_the_checkpointer_leaves_the_warning_filters_alone() -> None:
    # torch and its dependencies add filters of their own on import: they come first.
    code = (
        "import warnings, torch.distributed.checkpoint; before = list(warnings.filters); "
        "import warmstart.checkpoint.checkpointer; assert warnings.filters == before, warnings.filters"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)  # a hang guard
    assert done.returncode == 0, done.stderr
