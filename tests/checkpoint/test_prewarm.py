"""``Checkpointer.prewarm``: a throw-away copy on the stager's thread that writes nothing and leaves
the next save's result unchanged (added for the reference job; see docs/bench/main.md)."""

from __future__ import annotations

import pytest
import torch

from warmstart.checkpoint import AsyncMode, Checkpointer, OptimizerState, committed_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model_and_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, {"model": model, "optim": OptimizerState(model, optimizer)}


def test_prewarm_copies_in_the_background_and_writes_nothing(tmp_path):
    model, state = _model_and_state(0)
    with Checkpointer(tmp_path / "ckpt", mode=AsyncMode.ASYNC, keep=2, overlap_staging=True) as ckpt:
        future = ckpt.prewarm(state)
        assert future is not None
        future.result(timeout=60)
        assert committed_checkpoints(tmp_path / "ckpt") == []
        with torch.no_grad():  # weights change after the pre-warm: the save must hold the new ones
            for p in model.parameters():
                p.add_(1.0)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save(3, state)
        ckpt.wait()
    restored, restored_state = _model_and_state(1)
    with Checkpointer(tmp_path / "ckpt", mode=AsyncMode.ASYNC) as ckpt:
        assert ckpt.load_latest(restored_state) == 3
    for key, value in restored.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_prewarm_is_a_no_op_for_synchronous_saves(tmp_path):
    _, state = _model_and_state(0)
    with Checkpointer(tmp_path / "ckpt", mode=AsyncMode.SYNC) as ckpt:
        assert ckpt.prewarm(state) is None
