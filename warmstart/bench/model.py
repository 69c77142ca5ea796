"""The DLRM-style model of the reference job: sharded embedding tables plus a compiled dense part.

``DLRMTrain`` is the module TorchRec shards: its ``sparse_arch`` is an ``EmbeddingBagCollection``
(one table per sparse feature, sharded by ``DistributedModelParallel``), its ``dense_over`` holds
the dense arch (bottom MLP), the pairwise dot-product interaction, the over arch (top MLP) and the
loss, all in one module so ``torch.compile`` sees them as one graph. This module owns the model's
shape only; building, sharding and compiling it is the trainer's job.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from warmstart.bench.data import NUM_DENSE, TableSpec


class MLP(nn.Sequential):
    """``nn.Sequential`` with a ``forward`` of its own: ``MLP.compile()`` compiles it. (Dynamo does not
    start tracing in torch's own modules, so ``nn.Sequential(...).compile()`` alone would run eagerly.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


def _mlp(sizes: list[int], *, last_relu: bool) -> MLP:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return MLP(*layers)


class DenseOverArch(nn.Module):
    """Dense arch, dot-product interaction, over arch and BCE loss: the part that gets compiled.

    Args:
        num_sparse: Number of pooled sparse features (one per table).
        dim: Embedding dimension; the dense arch projects to it too.
        dense_layers: Hidden sizes of the dense arch.
        over_layers: Hidden sizes of the over arch.
    """

    _tri_rows: torch.Tensor  # buffers: the upper triangle's indices, the pairs that interact
    _tri_cols: torch.Tensor

    def __init__(self, num_sparse: int, dim: int, dense_layers: list[int], over_layers: list[int]) -> None:
        super().__init__()
        self.num_sparse, self.dim = num_sparse, dim
        self.dense_arch = _mlp([NUM_DENSE, *dense_layers, dim], last_relu=True)
        n = num_sparse + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("_tri_rows", rows, persistent=False)
        self.register_buffer("_tri_cols", cols, persistent=False)
        self.over_arch = _mlp([dim + n * (n - 1) // 2, *over_layers, 1], last_relu=False)

    def compile_regions(self, **compile_kwargs: Any) -> None:
        """Compile the dense arch and the over arch each on its own (regional compilation).

        Each region gets its own graph and cache entries, so a change to one (a layer added to the
        over arch, an activation changed in the dense arch) recompiles that region only; the other is
        read from the compile cache. The interaction between them (a batched matmul and a gather) runs
        eagerly.
        """
        self.dense_arch.compile(**compile_kwargs)
        self.over_arch.compile(**compile_kwargs)

    def forward(
        self, dense: torch.Tensor, sparse_values: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(loss, logits)`` for one batch.

        Args:
            dense: ``[B, 13]`` dense features.
            sparse_values: ``[B, num_sparse * dim]`` pooled embeddings (``KeyedTensor.values()``).
            labels: ``[B]`` clicks in {0, 1}.
        """
        d = self.dense_arch(dense)
        stacked = torch.cat([d.unsqueeze(1), sparse_values.view(-1, self.num_sparse, self.dim)], dim=1)
        interactions = torch.bmm(stacked, stacked.transpose(1, 2))[:, self._tri_rows, self._tri_cols]
        logits = self.over_arch(torch.cat([d, interactions], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return loss, logits.detach()


class DLRMTrain(nn.Module):
    """The whole model: ``sparse_arch`` (EmbeddingBagCollection) feeding ``dense_over``.

    Attributes:
        pooled_grad_hook: when set, called with the gradient of the pooled embeddings during
            backward: after the dense part's backward, before the tables' own backward (where
            TorchRec's fused optimizer writes the tables). The trainer uses it to wait for a
            checkpoint's copy of the tables as late as possible.
    """

    def __init__(self, sparse_arch: EmbeddingBagCollection, dense_over: DenseOverArch) -> None:
        super().__init__()
        self.sparse_arch = sparse_arch
        self.dense_over = dense_over
        self.pooled_grad_hook: Callable[[torch.Tensor], None] | None = None

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(loss, logits)``, the form TorchRec's train pipelines expect."""
        pooled = self.sparse_arch(batch.sparse_features).values()
        if self.pooled_grad_hook is not None and pooled.requires_grad:
            pooled.register_hook(self.pooled_grad_hook)
        return self.dense_over(batch.dense_features, pooled, batch.labels)


def embedding_configs(tables: list[TableSpec], dim: int) -> list[EmbeddingBagConfig]:
    """TorchRec table configs for ``tables`` (sum pooling, one feature per table)."""
    return [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=dim,
            num_embeddings=t.num_embeddings,
            feature_names=[t.feature],
            pooling=PoolingType.SUM,
        )
        for t in tables
    ]
