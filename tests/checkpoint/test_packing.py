"""Packing a snapshot's state into one reused buffer, and the ranks' shares of replicated state put
back together: what goes in comes out bit for bit, whatever the dtypes, shapes and byte boundaries."""

from __future__ import annotations

import pytest
import torch

from warmstart.checkpoint import packing
from warmstart.checkpoint.snapshot import _chunk, _nbytes, _share_of


def _round_trip(state, buffer=None, shared=None, copy=True):
    plan = packing.layout(state, shared)
    buffer = packing.buffer_for(plan, buffer)
    packing.copy_into(plan, buffer)
    return packing.unpack(bytes(packing.seal(plan, buffer)), copy=copy), buffer


def test_every_kind_of_value_comes_back_as_it_went_in():
    rows = torch.randn(50, 3)
    state = {
        "float": torch.randn(5, 7),
        "strided": torch.randn(6, 4).t(),
        "empty": torch.empty(0, 9),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "flags": torch.tensor([True, False, True]),
        "half": torch.randn(11).to(torch.bfloat16),
        "param": torch.nn.Parameter(torch.randn(4)),
        "ints": torch.arange(13, dtype=torch.int16),
        "rows": packing.Rows(rows, torch.tensor([0, 7, 49])),
        "plain": [1, 2.5, "x", None, b"\x00\x01", (True, [3])],
    }
    out, _ = _round_trip(state)
    for key in ("float", "strided", "empty", "scalar", "flags", "half", "ints"):
        assert out[key].dtype == state[key].dtype and torch.equal(out[key], state[key]), key
    assert torch.equal(out["param"], state["param"].detach())
    assert torch.equal(out["rows"], rows[[0, 7, 49]])
    assert out["plain"] == [1, 2.5, "x", None, b"\x00\x01", (True, [3])]


def test_a_buffer_is_reused_and_what_changes_after_the_copy_is_not_packed():
    t = torch.zeros(1000)
    extra = {"position": 7}
    state = {"t": t, "extra": extra}
    plan = packing.layout(state)
    buffer = packing.buffer_for(plan, None)
    packing.copy_into(plan, buffer)
    t.fill_(1.0)  # the next step changes the live state before the send
    extra["position"] = 8
    out = packing.unpack(packing.seal(plan, buffer))
    assert out["t"].sum().item() == 0 and out["extra"]["position"] == 7
    assert packing.buffer_for(packing.layout(state), buffer) is buffer  # same size: the same memory


def test_a_skeleton_larger_than_the_room_kept_for_it_is_sealed_all_the_same():
    state = {"blob": b"s" * (2 * packing.SKELETON_ROOM), "t": torch.arange(10)}
    out, _ = _round_trip(state)
    assert out["blob"] == state["blob"] and torch.equal(out["t"], state["t"])


def test_copies_own_their_memory_and_views_read_the_blob():
    plan = packing.layout({"t": torch.arange(8, dtype=torch.int64)})
    buffer = packing.buffer_for(plan, None)
    packing.copy_into(plan, buffer)
    blob = bytearray(packing.seal(plan, buffer))
    owned, view = packing.unpack(blob)["t"], packing.unpack(blob, copy=False)["t"]
    blob[:8] = (99).to_bytes(8, "little")
    assert owned[0].item() == 0 and view[0].item() == 99


def test_shared_tensors_are_left_out_and_put_back():
    big, small = torch.randn(100), torch.randn(3)
    out, _ = _round_trip({"dense": {"w": big, "b": small}}, shared={id(big): 0})
    assert isinstance(out["dense"]["w"], dict)  # a reference, not the tensor
    replacement = torch.randn(100)
    resolved = packing.resolve(out, [replacement])
    assert resolved["dense"]["w"] is replacement and torch.equal(resolved["dense"]["b"], small)
    with pytest.raises(ValueError, match="shared tensor 0 of 0"):
        packing.resolve(out, [])


@pytest.mark.parametrize(
    "blob", [b"", b"WSP1", b"x" * 100, b"\x00" * 8 + b"WSP1"], ids=["empty", "magic", "junk", "empty-skeleton"]
)
def test_anything_else_is_refused_with_a_value_error(blob):
    with pytest.raises(ValueError):
        packing.unpack(blob)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_the_ranks_shares_put_together_are_the_replicated_tensors(world):
    """Tensors of odd byte sizes and dtypes, split at byte boundaries that cut through elements: each
    rank's pieces, padded to the chunk as a gather pads them, give back every tensor bit for bit."""
    tensors = [torch.randn(7), torch.arange(5, dtype=torch.int16), torch.randn(3, 3).double(), torch.tensor(True)]
    shares = [_share_of(tensors, rank, world) for rank in range(world)]
    specs = shares[0]["specs"]
    total = sum(_nbytes(d, s) for d, s in specs)
    chunk = _chunk(total, world)
    padded = []
    for share in shares:
        mine = torch.zeros(chunk, dtype=torch.uint8)
        data = torch.cat([p.reshape(-1) for p in share["pieces"]]) if share["pieces"] else torch.empty(0)
        mine[: data.numel()] = data
        padded.append(mine)
    flat, offset = torch.cat(padded), 0
    for (dtype, shape), original in zip(specs, tensors, strict=True):
        n = _nbytes(dtype, shape)
        back = flat[offset : offset + n].clone().view(getattr(torch, dtype)).view(shape)
        assert torch.equal(back, original)
        offset += n
