"""Nested state packed into one flat byte buffer: the tensors' bytes copied once, straight into
place, then a small skeleton of everything else after them.

A per-step snapshot moves tens of megabytes a step; ``torch.save`` would copy them twice more (into
its archive, then out of it) and allocate fresh memory every time. Here the caller's step thread
copies the tensors into a buffer it reuses (:func:`copy_into`, the only copy), another thread seals
it with the skeleton (:func:`seal`, a few kilobytes of pickle), and :func:`unpack` reads the tensors
back as views of the received bytes. Layout of a sealed blob::

    tensor bytes (each at a 64-byte aligned offset) | skeleton (torch.save) | skeleton length (u64) | b"WSP1"

The skeleton is loaded with ``weights_only=True``: containers, plain values and tensors only.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

_ALIGN = 64
_TRAILER = struct.Struct("<Q4s")
_MAGIC = b"WSP1"
_REF = "__warmstart_tensor__"
_SHARED = "__warmstart_shared__"
SKELETON_ROOM = 1 << 16
"""Bytes a buffer keeps after the tensors for the skeleton (a larger one is sealed with a copy)."""


@dataclasses.dataclass(frozen=True)
class Rows:
    """The rows ``index`` of ``source`` (along its first dimension), packed as one tensor: gathered
    straight into the buffer, with no tensor of their own in between."""

    source: torch.Tensor
    index: torch.Tensor


@dataclasses.dataclass
class Layout:
    """Where each tensor of a state goes in the buffer, and the state without its tensors."""

    skeleton: Any
    sources: list[torch.Tensor | Rows | None]
    """What is still to be copied (``None`` once copied)."""
    specs: list[tuple[str, tuple[int, ...], int]]
    """(dtype name, shape, offset) of each tensor, in ``sources`` order."""
    data_bytes: int


def layout(state: Any, shared: Mapping[int, int] | None = None) -> Layout:
    """Plans the packing of ``state`` (dicts, lists, tuples, tensors and plain values). New
    containers are made, so that later changes to the caller's own dicts are not packed. A tensor
    whose ``id`` is a key of ``shared`` is not packed: it is left as a reference to its value there,
    for :func:`resolve` to put back."""
    shared = shared or {}
    sources: list[torch.Tensor | Rows | None] = []
    specs: list[tuple[str, tuple[int, ...], int]] = []
    end = 0

    def place(source: torch.Tensor | Rows, dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, int]:
        nonlocal end
        offset = -(-end // _ALIGN) * _ALIGN
        end = offset + _numel(shape) * dtype.itemsize
        sources.append(source)
        specs.append((str(dtype).removeprefix("torch."), shape, offset))
        return {_REF: len(sources) - 1}

    def walk(value: Any) -> Any:
        if isinstance(value, Rows):
            return place(value, value.source.dtype, (value.index.numel(), *value.source.shape[1:]))
        if isinstance(value, torch.Tensor) and id(value) in shared:
            return {_SHARED: shared[id(value)]}
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter):
            if value.is_sparse or value.is_quantized or value.device.type != "cpu":
                return value.detach().to("cpu", copy=True)  # rare: whole, in the skeleton
            return place(value, value.dtype, tuple(value.shape))  # (copied under no_grad)
        if isinstance(value, torch.Tensor):  # a tensor subclass: a copy, in the skeleton
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        return copy.deepcopy(value)

    skeleton = walk(state)
    return Layout(skeleton, sources, specs, end)


def buffer_for(
    plan: Layout, current: torch.Tensor | None, new: Callable[[int], torch.Tensor] | None = None
) -> torch.Tensor:
    """``current`` when it holds ``plan``'s tensors and a skeleton, else a new, larger buffer (of
    ``new(nbytes)``, a 1-D ``uint8`` tensor; default ``torch.empty``)."""
    need = plan.data_bytes + SKELETON_ROOM
    if current is not None and current.numel() >= need:
        return current
    nbytes = need + need // 4
    return torch.empty(nbytes, dtype=torch.uint8) if new is None else new(nbytes)


def copy_into(plan: Layout, buffer: torch.Tensor, select: Callable[[Any], bool] | None = None) -> None:
    """Copies the tensors of ``plan`` into ``buffer`` (see :func:`buffer_for`) and lets go of them:
    all of them, or those ``select`` is true of (the rest in a later call)."""
    with torch.no_grad():
        for i, (source, (_, shape, offset)) in enumerate(zip(plan.sources, plan.specs, strict=True)):
            if source is None or (select is not None and not select(source)):
                continue
            plan.sources[i] = None
            tensor = source.source if isinstance(source, Rows) else source
            nbytes = _numel(shape) * tensor.element_size()
            if not nbytes:
                continue
            out = buffer[offset : offset + nbytes].view(tensor.dtype).view(shape)
            if isinstance(source, Rows):
                torch.index_select(source.source, 0, source.index, out=out)
            else:
                out.copy_(source)


def seal(plan: Layout, buffer: torch.Tensor) -> memoryview:
    """The packed blob: ``buffer``'s tensor bytes (after :func:`copy_into`) and the skeleton; a view
    of the buffer's first bytes when the skeleton fits in the room kept for it, else a copy (whose
    ``obj`` is ``bytes``)."""
    out = io.BytesIO()
    torch.save({"skeleton": plan.skeleton, "tensors": plan.specs}, out)
    tail = out.getvalue() + _TRAILER.pack(len(out.getvalue()), _MAGIC)
    end = plan.data_bytes + len(tail)
    data = buffer.numpy().data.cast("B")
    if end <= len(data):
        data[plan.data_bytes : end] = tail
        return data[:end]
    return memoryview(bytes(data[: plan.data_bytes]) + tail)  # a skeleton larger than the room kept


def unpack(blob: Any, *, copy: bool = True) -> Any:
    """The state packed in ``blob`` (any bytes-like object), with tensors of their own, or with
    views of ``blob`` (``copy=False``: for state only read from, as torch's RNG setters, for one,
    do not take a view of foreign memory).

    Raises:
        ValueError: ``blob`` is not a packed state.
    """
    view = memoryview(blob).cast("B")
    if len(view) < _TRAILER.size:
        raise ValueError("not a packed state: too short")
    length, magic = _TRAILER.unpack(view[len(view) - _TRAILER.size :])
    start = len(view) - _TRAILER.size - length
    if magic != _MAGIC or start < 0:
        raise ValueError("not a packed state")
    try:
        head = torch.load(io.BytesIO(view[start : len(view) - _TRAILER.size]), weights_only=True)
        specs = [(str(d), tuple(int(n) for n in shape), int(o)) for d, shape, o in head["tensors"]]
        skeleton = head["skeleton"]
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler makes of bad bytes
        raise ValueError(f"not a packed state: its skeleton does not load ({type(exc).__name__})") from None
    with warnings.catch_warnings():  # a read-only blob: its views are only read from
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(view, dtype=torch.uint8) if start else torch.empty(0, dtype=torch.uint8)
    tensors = []
    for dtype_name, shape, offset in specs:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a packed state: no dtype {dtype_name!r}")
        nbytes = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        if offset + nbytes > start:
            raise ValueError("not a packed state: a tensor runs past the data")
        view_of = flat[offset : offset + nbytes].view(dtype).view(shape)
        tensors.append(view_of.clone() if copy else view_of)

    def build(value: Any) -> Any:
        if isinstance(value, dict):
            if len(value) == 1 and _REF in value:
                return tensors[value[_REF]]
            return {k: build(v) for k, v in value.items()}
        if isinstance(value, list):
            return [build(v) for v in value]
        if isinstance(value, tuple):
            return tuple(build(v) for v in value)
        return value

    return build(skeleton)


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def resolve(state: Any, shared: Sequence[torch.Tensor]) -> Any:
    """``state`` (from :func:`unpack`) with each reference left by ``layout(..., shared)`` replaced
    by its tensor in ``shared``.

    Raises:
        ValueError: a reference past the end of ``shared``.
    """
    if isinstance(state, dict):
        if len(state) == 1 and _SHARED in state:
            index = state[_SHARED]
            if not 0 <= index < len(shared):
                raise ValueError(f"a shared tensor {index} of {len(shared)}")
            return shared[index]
        return {k: resolve(v, shared) for k, v in state.items()}
    if isinstance(state, list):
        return [resolve(v, shared) for v in state]
    if isinstance(state, tuple):
        return tuple(resolve(v, shared) for v in state)
    return state
