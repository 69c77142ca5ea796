"""Synthetic click logs for the reference job: Criteo-shaped batches, deterministic per (rank, step).

A batch holds dense features (log-normal counts, as Criteo's integer features after ``log1p``),
one multi-hot sparse feature per embedding table (lengths drawn around a per-table mean, ids
drawn from a power law so a few ids are hot, as in real logs) and click labels from a hidden
logistic model, so the loss really goes down. Each batch is a pure function of ``(seed, rank,
step)``: a restart that resumes at step ``s`` sees exactly the data an uninterrupted run would
have seen, with no loader state to save. This module owns the data only; it never touches the
model or the process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_DENSE = 13  # Criteo's integer features


@dataclasses.dataclass(frozen=True, slots=True)
class TableSpec:
    """One embedding table and the sparse feature that looks it up."""

    name: str
    """Table name (``t00``, ``t01``, ...)."""
    feature: str
    """Feature name (``f00``, ...); one feature per table."""
    num_embeddings: int
    """Rows in the table (the id range of the feature)."""
    mean_pooling: float
    """Mean number of ids per sample (multi-hot length)."""


def make_tables(num_tables: int, *, rows_min: int, rows_max: int, seed: int = 0) -> list[TableSpec]:
    """Tables with log-uniform row counts and pooling factors, fixed by ``seed``.

    Args:
        num_tables: How many tables (and sparse features).
        rows_min: Fewest rows a table may have.
        rows_max: Most rows a table may have.
        seed: Picks the sizes; the same seed gives the same tables on every rank and attempt.
    """
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(rows_min), np.log(rows_max), num_tables)).astype(np.int64)
    pooling = rng.uniform(1.0, 8.0, num_tables)
    return [
        TableSpec(f"t{i:02d}", f"f{i:02d}", int(r), float(p))
        for i, (r, p) in enumerate(zip(rows, pooling, strict=True))
    ]


class ClickLogDataset(IterableDataset):
    """An endless stream of ready-made batches, starting at ``start_step``.

    Args:
        tables: The tables (one sparse feature each).
        batch_size: Samples per batch (per rank).
        rank: Global rank; every rank sees its own part of the log.
        start_step: First step to produce (resume point).
        seed: Data seed.
    """

    def __init__(
        self, tables: list[TableSpec], batch_size: int, *, rank: int, start_step: int = 0, seed: int = 0
    ) -> None:
        super().__init__()
        self.tables, self.batch_size, self.rank = tables, batch_size, rank
        self.start_step, self.seed = start_step, seed
        hidden = np.random.default_rng(seed + 1)
        # The hidden click model: a linear effect of the dense features plus a per-id effect of the
        # first few sparse features, so the embeddings have something to learn.
        self._dense_weight = hidden.normal(0.0, 0.5, NUM_DENSE)
        self._id_effect = [hidden.normal(0.0, 1.0, 997) for _ in range(min(4, len(tables)))]

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        step = self.start_step + worker
        while True:
            yield self.batch(step)
            step += workers

    def batch(self, step: int) -> Batch:
        """The batch of global step ``step`` for this rank."""
        rng = np.random.default_rng([self.seed, self.rank, step])
        size = self.batch_size
        dense = np.log1p(rng.lognormal(1.0, 1.5, (size, NUM_DENSE))).astype(np.float32)
        lengths, values = [], []
        logit = dense @ self._dense_weight - 2.0
        for i, table in enumerate(self.tables):
            length = np.minimum(rng.poisson(table.mean_pooling, size), 4 * int(table.mean_pooling) + 4)
            # Power law over ids: id = rows**u - 1 with u uniform is log-uniform, so low ids are hot.
            ids = (np.power(float(table.num_embeddings), rng.random(int(length.sum()))) - 1).astype(np.int64)
            if i < len(self._id_effect):
                first = np.concatenate([[0], np.cumsum(length)[:-1]])
                has = length > 0
                effect = np.zeros(size)
                effect[has] = self._id_effect[i][ids[first[has]] % 997]
                logit += effect
            lengths.append(length)
            values.append(ids)
        labels = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        # KeyedJaggedTensor layout: feature-major lengths, values of feature 0 first.
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[t.feature for t in self.tables],
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
        )
        return Batch(dense_features=torch.from_numpy(dense), sparse_features=kjt, labels=torch.from_numpy(labels))


def make_loader(dataset: ClickLogDataset, *, num_workers: int = 1, prefetch_factor: int = 4) -> DataLoader:
    """A plain ``DataLoader`` over ready-made batches (``batch_size=None``), with worker processes."""
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=False,
    )
