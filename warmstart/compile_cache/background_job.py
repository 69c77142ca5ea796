"""What a background compile's job (``background.py``) and its worker (``background_worker.py``) share:
the specs of the inputs a job file carries, from which the worker makes tensors alike, and how each
side reads a process's start time (a worker ends with its job). No torch import at module level:
the job's side imports this before it knows it will compile in the background.
"""

from __future__ import annotations

from typing import Any


def start_time(pid: int) -> str | None:
    """``pid``'s start time, ``None`` when it has ended (a zombie has ended: only its parent has not
    read its status yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class TensorSpec:
    """A tensor's shape, strides, dtype, device and ``requires_grad``, for a worker to make one alike."""

    def __init__(self, shape: tuple, stride: tuple, dtype: Any, device: str, requires_grad: bool) -> None:
        self.shape, self.stride, self.dtype, self.device, self.requires_grad = (
            shape,
            stride,
            dtype,
            device,
            requires_grad,
        )

    def make(self) -> Any:
        import torch

        empty = any(s == 0 for s in self.shape)
        storage = 0 if empty else sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True)) + 1
        if self.dtype.is_floating_point or self.dtype.is_complex:
            flat = torch.randn(storage, dtype=self.dtype, device=self.device)
        else:  # integers index: zeros are in range of anything they index
            flat = torch.zeros(storage, dtype=self.dtype, device=self.device)
        tensor = torch.as_strided(flat, self.shape, self.stride).detach()
        return tensor.requires_grad_(self.requires_grad)

    def __repr__(self) -> str:
        return f"Tensor{self.shape}/{self.stride}/{self.dtype}/{self.device}/{self.requires_grad}"
