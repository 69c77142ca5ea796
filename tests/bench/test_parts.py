"""The reference job's parts on their own (fast): data, configuration, model shapes, CLI checks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from warmstart.bench.config import JobConfig
from warmstart.bench.data import NUM_DENSE, ClickLogDataset, make_tables
from warmstart.bench.model import DenseOverArch
from warmstart.errors import ConfigError


@pytest.fixture(scope="module")
def tables():
    return make_tables(6, rows_min=100, rows_max=5000, seed=3)


def test_batches_are_a_function_of_rank_and_step(tables):
    a = ClickLogDataset(tables, 32, rank=0, seed=1)
    b = ClickLogDataset(tables, 32, rank=0, start_step=5, seed=1)
    first, again = a.batch(5), next(iter(b))  # a resumed loader starts with exactly that batch
    assert torch.equal(first.dense_features, again.dense_features)
    assert torch.equal(first.sparse_features.values(), again.sparse_features.values())
    assert torch.equal(first.labels, again.labels)
    other_rank = ClickLogDataset(tables, 32, rank=1, seed=1).batch(5)
    assert not torch.equal(first.sparse_features.values(), other_rank.sparse_features.values())


def test_batches_look_like_click_logs(tables):
    ds = ClickLogDataset(tables, 2048, rank=0, seed=1)
    batch = ds.batch(0)
    kjt = batch.sparse_features
    assert batch.dense_features.shape == (2048, NUM_DENSE)
    assert kjt.keys() == [t.feature for t in tables]
    assert set(batch.labels.unique().tolist()) == {0.0, 1.0}
    assert 0.05 < batch.labels.mean().item() < 0.6  # a click-through rate, not a coin flip
    for table, jt in zip(tables, kjt.to_dict().values()):
        ids = jt.values().numpy()
        assert ids.min() >= 0 and ids.max() < table.num_embeddings
        assert abs(jt.lengths().float().mean().item() - table.mean_pooling) < 0.5
        # power law: the lowest 1% of ids draw more than ten times their share of the lookups
        assert np.mean(ids < max(1, table.num_embeddings // 100)) > 0.1


def test_dense_over_arch_returns_a_scalar_loss_and_logits():
    arch = DenseOverArch(num_sparse=4, dim=8, dense_layers=[16], over_layers=[16])
    loss, logits = arch(torch.randn(5, NUM_DENSE), torch.randn(5, 4 * 8, requires_grad=True), torch.ones(5))
    assert loss.shape == () and logits.shape == (5,)
    loss.backward()
    assert all(p.grad is not None for p in arch.parameters())


def test_config_round_trips_through_flags_and_rejects_bad_values():
    cfg = JobConfig(mode="baseline", steps=50, tables=70, dense_layers=(64, 32), fail_at_step=20)
    assert JobConfig.from_args(cfg.to_args()) == cfg
    with pytest.raises(ConfigError, match="--mode"):
        JobConfig(mode="fast")
    with pytest.raises(ConfigError, match="--fail-at-step"):
        JobConfig(steps=10, fail_at_step=10)
    with pytest.raises(ConfigError, match="--checkpoint-mode"):
        JobConfig(checkpoint_mode="later")


def test_cli_rejects_a_failure_step_past_the_end():
    done = subprocess.run([sys.executable, "-m", "warmstart", "bench", "cold-vs-warm", "--steps", "10",
                           "--fail-at-step", "12"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--fail-at-step" in done.stderr and "--steps" in done.stderr
