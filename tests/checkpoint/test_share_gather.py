"""The ranks' shares of replicated state gathered over a real gloo group (2 processes): put back bit
for bit when the ranks split the same tensors, refused on every rank when they do not (a sharded
optimizer's state, which differs between ranks)."""

from __future__ import annotations

import socket
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from warmstart.checkpoint.snapshot import StepSnapshots, _share_of


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, case: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same "replicated" tensors on both ranks
        tensors = [torch.randn(5, 3), torch.arange(7, dtype=torch.int64), torch.randn(4).double()]
        if case == "different" and rank == 1:
            tensors = tensors[:2]  # this rank holds less optimizer state: the bytes split differently
        share = _share_of(tensors, rank, 2)
        got = StepSnapshots._gather_share(types.SimpleNamespace(world=2), share)  # type: ignore[arg-type]
        out[rank] = None if got is None else [t.clone() for t in got]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["same", "different"])
def test_shares_gathered_over_gloo(case):
    with mp.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        mp.start_processes(_rank, args=(port, case, out), nprocs=2, join=True, start_method="spawn")
        results = dict(out)
    torch.manual_seed(0)
    expected = [torch.randn(5, 3), torch.arange(7, dtype=torch.int64), torch.randn(4).double()]
    if case == "same":
        for rank in (0, 1):
            assert len(results[rank]) == 3
            assert all(torch.equal(a, b) for a, b in zip(results[rank], expected, strict=True))
    else:
        assert results == {0: None, 1: None}  # refused everywhere: both go on from the checkpoint


@pytest.mark.parametrize("every", [0, -3, 1.5, True, "2"])
def test_a_spacing_that_is_not_a_whole_number_of_steps_is_refused(every):
    with pytest.raises(ValueError, match=r"every=.*expected a whole number of steps, 1 or more"):
        StepSnapshots(torch.nn.Linear(2, 2), None, keeper="unix:/nonexistent", job="j", rank=0, world=1, every=every)


def test_a_copy_that_never_finishes_costs_one_bounded_wait_then_snapshots_turn_off(monkeypatch):
    """A stalled overlapped copy (its thread never signals): the dense optimizer's step waits once,
    for the bound, then snapshots are off and later steps do not wait at all."""
    import time

    import warmstart.checkpoint.snapshot as snapshot_module

    monkeypatch.setattr(snapshot_module, "_COPY_WAIT_S", 0.3)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    snaps = StepSnapshots(model, optimizer, keeper="unix:/nonexistent", job="j", rank=0, world=1, overlap=True)
    assert snaps.overlap  # the optimizer's step hook is the guard
    snaps._copied.clear()  # a copy in flight that never ends
    started = time.monotonic()
    for _ in range(5):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    assert time.monotonic() - started < 1.2  # one 0.3 s wait, not five (1.5 s)
    assert snaps.off and "did not finish within 0.3 s" in snaps.off
