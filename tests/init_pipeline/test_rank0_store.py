"""A rank that reaches an ``env://`` rendezvous before rank 0's store listens waits for it by looking,
not by torch's back-off: against real TCPStores on free ports."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from warmstart.init_pipeline.stages import _wait_for_rank0_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(port: int) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_waits_until_rank0s_store_listens_and_leaves_it_working():
    port = _free_port()
    stores: list[dist.TCPStore] = []
    started_at: list[float] = []

    def rank0() -> None:
        started_at.append(time.monotonic())
        stores.append(dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False))

    starter = threading.Timer(0.3, rank0)
    starter.start()
    try:
        assert _wait_for_rank0_store(_env(port), timeout_s=60) is True
        assert started_at, "returned before rank 0 began to start its store"
        starter.join()
        # The looks were connections opened and closed: the store still serves the real client.
        client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
        client.set("from-rank-1", "ok")
        assert stores[0].get("from-rank-1") == b"ok"
    finally:
        starter.join()


def test_gives_up_at_its_bound_when_nothing_listens():
    start = time.monotonic()
    assert _wait_for_rank0_store(_env(_free_port()), timeout_s=0.3) is False
    assert time.monotonic() - start < 10  # a hang guard, not a speed target


def test_nothing_to_wait_for_under_torchruns_agent_store_or_without_env_rendezvous():
    unused = _env(_free_port())
    assert _wait_for_rank0_store({**unused, "TORCHELASTIC_USE_AGENT_STORE": "True"}, timeout_s=30) is True
    assert _wait_for_rank0_store({}, timeout_s=30) is False
    assert _wait_for_rank0_store({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "not-a-port"}, timeout_s=30) is False
