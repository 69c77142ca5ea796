"""Small TorchRec models, planners and stores shared by the init-pipeline tests."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.stats import NoopEmbeddingStats

from warmstart.compile_cache import open_store
from warmstart.config import Settings

warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")
logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)


def tables(n: int = 4, *, rows: int = 100, dim: int = 16) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows * (i + 1), feature_names=[f"f{i}"])
        for i in range(n)
    ]


class TwoTowers(nn.Module):
    """Sharded tables under a nested path, plus a dense layer (so storage reservation sees it)."""

    def __init__(self, configs: list[EmbeddingBagConfig], device: torch.device, dense: int = 8) -> None:
        super().__init__()
        self.sparse = nn.ModuleDict({"ebc": EmbeddingBagCollection(tables=configs, device=device)})
        self.dense = nn.Linear(dense, 4, device=device)


def model(configs: list[EmbeddingBagConfig] | None = None, dense: int = 8) -> TwoTowers:
    return TwoTowers(configs or tables(), torch.device("meta"), dense)


def planner(
    world_size: int = 2, *, device: str = "cpu", batch_size: int = 8, cls: type = EmbeddingShardingPlanner, **kwargs
) -> EmbeddingShardingPlanner:
    topology_kwargs = {k: kwargs.pop(k) for k in ("hbm_cap", "ddr_cap", "local_world_size") if k in kwargs}
    topology = Topology(world_size=world_size, compute_device=device, **topology_kwargs)
    return cls(topology=topology, batch_size=batch_size, stats=NoopEmbeddingStats(), **kwargs)


def sharders(**fused_params) -> list[EmbeddingBagCollectionSharder]:
    return [EmbeddingBagCollectionSharder(fused_params=fused_params or None)]


def local_store(directory: Path, cache_url: str | None = None, secret: bytes | None = None):
    """A store as a job on a machine whose local cache is ``directory`` would open it."""
    settings = Settings(enabled=True, cache_dir=directory, cache_url=cache_url, secret=secret, mode="rw")
    return open_store(settings, persist_stats=False)
