"""What the torchrun tests read back from ``_train.py``'s output folder."""

from __future__ import annotations

from pathlib import Path

import torch


def final_state(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s final parameters and optimizer state, flattened to ``/key/key...`` -> tensor."""
    flat: dict[str, torch.Tensor] = {}

    def walk(obj: object, prefix: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}/{k}")
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj

    walk(torch.load(out / f"final-r{rank}.pt", weights_only=False), "")
    return flat
