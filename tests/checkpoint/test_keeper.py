"""The snapshot keeper as a server: chains, gaps, memory bound, torn and unsigned frames, and a buddy
that is slow or gone (docs/checkpoint.md#per-step-snapshots)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _wait import until

from warmstart.checkpoint.keeper import (
    Keeper,
    KeeperClient,
    KeeperError,
    SharedPayload,
    _BuddyLink,
    _recv_frame,
    _send_frame,
    check_address,
    shared_memory,
    start_keeper,
)

SECRET = b"keeper-test"
_BUDDY_RETRY_S = _BuddyLink.RETRY_S + 0.2


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory short enough for AF_UNIX socket paths (107 bytes), whatever the caller's TMPDIR."""
    path = Path(tempfile.mkdtemp(prefix="ws-k-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def keeper(short_dir):
    k = Keeper([f"unix:{short_dir / 'k.sock'}"], secret=SECRET, max_bytes=10_000).start()
    yield k
    k.stop()


def _client(k: Keeper) -> KeeperClient:
    return KeeperClient(k.addresses[0], secret=SECRET, timeout_s=5.0)


def _put(c: KeeperClient, step: int, since: int, *, base: int = -1, full: bool = False, rank: int = 0, size: int = 10):
    header = {"op": "put", "job": "j", "rank": rank, "world": 2, "step": step, "since": since, "base": base}
    return c.request({**header, "full": full}, [b"r" * size, b"w" * size])


def _restorable(c: KeeperClient, rank: int = 0) -> list[int]:
    return c.request({"op": "status", "job": "j"})[0]["ranks"][str(rank)]["restorable"]


def test_a_chain_is_good_from_its_base_up_to_its_first_gap(keeper):
    c = _client(keeper)
    _put(c, 6, 5, base=5)
    _put(c, 7, 6, base=5)
    _put(c, 9, 8, base=5)  # step 8's snapshot never came
    assert _restorable(c) == [6, 7]
    reply, payloads = c.request({"op": "get", "job": "j", "rank": 0, "step": 7})
    assert reply["steps"] == [6, 7] and len(payloads) == 3  # each step's rows, then the whole state of 7
    with pytest.raises(KeeperError, match="cannot be restored to step 9"):
        c.request({"op": "get", "job": "j", "rank": 0, "step": 9})


def test_a_newer_base_drops_what_its_checkpoint_holds_and_closes_an_old_gap(keeper):
    c = _client(keeper)
    _put(c, 6, 5, base=5)
    _put(c, 8, 7, base=5)  # a gap at 7
    _put(c, 9, 8, base=7)  # checkpoint 7 is durable: 8 follows it
    status = c.request({"op": "status", "job": "j"})[0]["ranks"]["0"]
    assert status["base"] == 7 and status["restorable"] == [8, 9]


def test_a_restarted_rank_going_on_from_an_earlier_step_voids_what_came_after_it(keeper):
    c = _client(keeper)
    for step in (6, 7, 8):
        _put(c, step, step - 1, base=5)
    _put(c, 8, 6, base=5)  # restored to 6 (another rank had only 6), then its step 7 was skipped
    assert _restorable(c) == [6, 8]


def test_a_full_snapshot_starts_a_chain_without_a_checkpoint(keeper):
    c = _client(keeper)
    _put(c, 0, -1, full=True)
    _put(c, 1, 0)
    assert _restorable(c) == [0, 1]


def test_the_memory_bound_refuses_a_snapshot_and_says_so(keeper):
    c = _client(keeper)
    _put(c, 6, 5, base=5, size=2000)
    with pytest.raises(KeeperError, match="memory bound \\(10000 bytes\\)"):
        _put(c, 7, 6, base=5, size=4000)
    status = c.request({"op": "status", "job": "j"})[0]
    assert status["held_bytes"] <= 10_000 and status["refused"] == 1
    assert status["ranks"]["0"]["restorable"] == [6]


def test_only_the_last_few_whole_states_are_held(keeper):
    c = _client(keeper)
    for step in range(6, 14):
        _put(c, step, step - 1, base=5, size=100)
    assert _restorable(c) == [10, 11, 12, 13]


def test_a_torn_frame_is_dropped_whole_and_the_keeper_goes_on(keeper, caplog):
    path = keeper.addresses[0][5:]
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(path)
    header = b'{"op":"put","job":"j","rank":0,"world":1,"step":6,"since":5,"base":5,"sizes":[1000,1000]}'
    raw.sendall(struct.pack(">4sI", b"WSK3", len(header)) + header + b"x" * 500)
    raw.close()  # the sender died half-way through its rows
    with caplog.at_level(logging.WARNING, logger="warmstart.checkpoint"):
        c = _client(keeper)
        _put(c, 7, 6, base=5)
        # the torn connection is read on a thread of its own: wait for its verdict (a hang guard)
        until(lambda: any("torn frame" in r.getMessage() for r in caplog.records), timeout=30)
    assert c.request({"op": "status", "job": "j"})[0]["ranks"]["0"]["restorable"] == []  # 6 never arrived


def _get(c: KeeperClient, step: int, rank: int = 0) -> list[bytes]:
    return [bytes(p) for p in c.request({"op": "get", "job": "j", "rank": rank, "step": step})[1]]


def test_memory_files_handed_over_hold_what_they_had_when_the_answer_came(keeper):
    """A rank's buffers go to the keeper as memory files; it reuses them once answered."""
    c = _client(keeper)
    fd, memory = shared_memory(4096)
    try:
        memory[:100] = b"a" * 100
        header = {"op": "put", "job": "j", "rank": 0, "world": 1, "step": 6, "since": 5, "base": 5}
        c.request(header, [SharedPayload(fd, 60), b"whole"])
        memory[:100] = b"b" * 100  # the next snapshot, in the same memory
        c.request({**header, "step": 7, "since": 6}, [SharedPayload(fd, 70), SharedPayload(fd, 10)])
    finally:
        memory.close()
        os.close(fd)
    assert _get(c, 6) == [b"a" * 60, b"whole"]
    assert _get(c, 7) == [b"a" * 60, b"b" * 70, b"b" * 10]


def test_a_handed_over_file_that_could_shrink_or_is_not_memory_is_refused(keeper, short_dir):
    path = keeper.addresses[0][5:]
    plain = os.memfd_create("unsealed")  # no seal: the sender could cut it under the keeper's copy
    os.ftruncate(plain, 100)
    disk = os.open(short_dir / "f", os.O_RDWR | os.O_CREAT)
    os.ftruncate(disk, 100)
    small, memory = shared_memory(10)
    header = {"op": "put", "job": "j", "rank": 0, "world": 1, "step": 6, "since": 5, "base": 5}
    try:
        for fd in (plain, disk, small):  # (the last one sealed, but smaller than it is said to be)
            with socket.socket(socket.AF_UNIX) as raw:
                raw.connect(path)
                _send_frame(raw, header, [SharedPayload(fd, 50)], None)
                assert _recv_frame(raw, None) is None  # dropped whole: the connection ends
    finally:
        memory.close()
        for fd in (plain, disk, small):
            os.close(fd)
    c = _client(keeper)
    _put(c, 7, 6, base=5)  # the keeper goes on
    assert _restorable(c) == []  # step 6 was never held


def test_a_payload_whose_sender_let_go_before_the_copy_is_dropped():
    """The sender gave up waiting and reuses its memory: what the keeper copied may be torn."""
    fd, memory = shared_memory(100)
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    try:
        _send_frame(ours, {"op": "put"}, [SharedPayload(fd, 100)], None)
        ours.close()  # (a timed-out request closes its connection before it reuses the buffer)
        with pytest.raises(KeeperError, match="let go of a handed-over payload"):
            _recv_frame(theirs, None)
        # the same frame from a sender still waiting is read whole (at once, whatever the timeout)
        ours, theirs = socket.socketpair(socket.AF_UNIX)
        theirs.settimeout(30.0)
        memory[:] = b"s" * 100
        _send_frame(ours, {"op": "put"}, [SharedPayload(fd, 100)], None)
        frame = _recv_frame(theirs, None)
        assert frame is not None and frame[1] == [b"s" * 100]
    finally:
        ours.close()
        theirs.close()
        memory.close()
        os.close(fd)


def test_memory_files_are_not_sent_where_they_cannot_be_handed_over():
    fd, memory = shared_memory(10)
    try:
        with socket.socket() as tcp, pytest.raises(KeeperError, match="Unix socket only"):
            _send_frame(tcp, {"op": "put"}, [SharedPayload(fd, 10)], SECRET)
    finally:
        memory.close()
        os.close(fd)


def test_a_frame_without_the_job_secret_is_refused_on_tcp(caplog):
    k = Keeper(["127.0.0.1:0"], secret=SECRET).start()
    try:
        with caplog.at_level(logging.WARNING, logger="warmstart.checkpoint"):
            stranger = KeeperClient(k.addresses[0], secret=b"another-secret", timeout_s=5.0)
            with pytest.raises(KeeperError):
                _put(stranger, 6, 5, base=5)
        assert "0" not in KeeperClient(k.addresses[0], secret=SECRET).request({"op": "status", "job": "j"})[0]["ranks"]
        assert any("not signed with this job's secret" in r.getMessage() for r in caplog.records)
    finally:
        k.stop()


def test_the_node_socket_is_its_users_alone(keeper):
    """No signature on the node's Unix socket: only the keeper's user can open it."""
    path = keeper.addresses[0][5:]
    assert os.stat(path).st_mode & 0o077 == 0


def test_tcp_without_a_secret_is_refused():
    with pytest.raises(KeeperError, match="needs a secret"):
        Keeper(["127.0.0.1:0"])
    with pytest.raises(KeeperError, match="expected unix:/path/to/socket or host:port"):
        check_address("keeper.sock")


def test_a_buddy_that_is_gone_costs_a_put_nothing_and_one_warning(short_dir, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    k = Keeper([f"unix:{short_dir / 'b.sock'}"], secret=SECRET, buddy=dead).start()
    try:
        with caplog.at_level(logging.WARNING, logger="warmstart.checkpoint"):
            c = _client(k)
            for step in range(6, 26):
                _put(c, step, step - 1, base=5)
            # the copies go from the link's own thread: wait until it has tried (a hang guard)
            until(lambda: c.request({"op": "status", "job": "j"})[0]["buddy"]["queued_bytes"] == 0, timeout=30)
            until(lambda: c.request({"op": "status", "job": "j"})[0]["buddy"]["dropped"] >= 1, timeout=30)
        warnings = [r for r in caplog.records if "snapshot buddy" in r.getMessage()]
        assert len(warnings) == 1 and dead in warnings[0].getMessage()
        assert _restorable(c)[-1] == 25  # the node's own copy is whole
        assert c.request({"op": "status", "job": "j"})[0]["buddy"]["sent"] == 0
    finally:
        k.stop()


def test_a_buddy_that_missed_snapshots_gets_the_whole_chain_with_the_next_one(short_dir):
    """The buddy is down for the first puts (the first of them a full snapshot: without it nothing
    after it restores), then comes up: with the next put it gets the rank's whole good run, and a
    node loss from then on restores the newest step from it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    k = Keeper([f"unix:{short_dir / 'n.sock'}"], secret=SECRET, buddy=f"127.0.0.1:{port}").start()
    buddy = None
    try:
        c = _client(k)
        _put(c, 0, -1, full=True)
        for step in range(1, 4):
            _put(c, step, step - 1)
        link = lambda: c.request({"op": "status", "job": "j"})[0]["buddy"]  # noqa: E731
        until(lambda: link()["behind"] == 1 and link()["queued_bytes"] == 0, timeout=30)  # every try failed
        buddy = Keeper([f"127.0.0.1:{port}"], secret=SECRET).start()
        b = KeeperClient(buddy.addresses[0], secret=SECRET, timeout_s=5.0)
        time.sleep(_BUDDY_RETRY_S)  # the link tries again after its back-off
        _put(c, 4, 3)
        until(
            lambda: 4 in b.request({"op": "status", "job": "j"})[0]["ranks"].get("0", {}).get("restorable", []),
            timeout=30,
        )
        assert _restorable(b) == [1, 2, 3, 4]  # steps 0-3 replayed (their whole states as held), then 4
        reply, payloads = b.request({"op": "get", "job": "j", "rank": 0, "step": 4})
        assert reply["steps"] == [0, 1, 2, 3, 4] and payloads[-1] == b"w" * 10
        assert c.request({"op": "status", "job": "j"})[0]["buddy"]["behind"] == 0
    finally:
        k.stop()
        if buddy is not None:
            buddy.stop()


def test_a_stopped_buddy_never_holds_up_the_keeper(short_dir):
    """The buddy hangs (SIGSTOP: its socket accepts, nothing is read): the keeper's puts stay as fast
    as before, its copy queue stays bounded in bytes."""
    ready = short_dir / "buddy.ready"
    buddy = subprocess.Popen(
        [sys.executable, "-m", "warmstart.checkpoint.keeper", "--listen", "127.0.0.1:0", "--ready-file", str(ready)],
        env={**os.environ, "WARMSTART_SECRET": SECRET.decode()},
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        address = ready.read_text().split()[0]
        os.kill(buddy.pid, 19)  # SIGSTOP
        k = Keeper([f"unix:{short_dir / 's.sock'}"], secret=SECRET, buddy=address, max_bytes=1 << 30).start()
        try:
            c = _client(k)
            for step in range(6, 66):  # 60 puts of 2 MiB: far beyond what the stopped buddy's socket takes
                _put(c, step, step - 1, base=5, size=1 << 20)
            assert _restorable(c)[-1] == 65
            assert c.request({"op": "status", "job": "j"})[0]["buddy"]["queued_bytes"] <= 256 << 20
        finally:
            k.stop()
    finally:
        buddy.kill()
        buddy.wait()


def test_start_keeper_outlives_its_starter_and_keeps_away_from_its_output(short_dir):
    address = f"unix:{short_dir / 'n.sock'}"
    starter = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from warmstart.checkpoint.keeper import start_keeper; print(start_keeper({address!r}))",
        ],
        capture_output=True,
        text=True,
        timeout=60,  # a hang guard: the keeper must not hold the starter's pipes open
    )
    assert starter.returncode == 0, starter.stderr
    pid = int(starter.stdout.strip())
    try:
        assert KeeperClient(address, timeout_s=5.0).request({"op": "ping"})[0]["pid"] == pid
        assert start_keeper(address) is None  # one answers there already
    finally:
        os.kill(pid, 9)


def _policies(pid: int) -> list[tuple[int, int]]:
    """(scheduling policy, nice) of each thread of ``pid``, as ``ps -L -o policy,nice`` shows them."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rpartition(")")[2].split()
        out.append((int(fields[38]), int(fields[16])))
    return out


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_a_keeper_takes_in_snapshots_on_idle_cpu_and_answers_questions_at_its_priority(short_dir):
    """Puts are served by threads a rank never outranks; a starting rank's status is not (the whole
    keeper at SCHED_IDLE would answer it only when the node's other work leaves a core idle)."""
    address = f"unix:{short_dir / 'p.sock'}"
    pid = start_keeper(address)
    assert pid is not None
    try:
        stream, asker = KeeperClient(address, timeout_s=5.0), KeeperClient(address, timeout_s=5.0)
        _put(stream, 6, 5, base=5)
        assert _restorable(asker) == [6]
        policies = _policies(pid)
        assert policies.count((os.SCHED_IDLE, 10)) == 1  # the thread serving the stream of puts
        assert all(p == (os.SCHED_OTHER, 10) for p in policies if p[0] != os.SCHED_IDLE)
    finally:
        os.kill(pid, 9)


def test_start_keeper_without_waiting_returns_the_pid_that_answers_soon_after(short_dir):
    address = f"unix:{short_dir / 'w.sock'}"
    pid = start_keeper(address, wait=False)
    try:

        def answers() -> bool:
            try:
                return KeeperClient(address, timeout_s=1.0).request({"op": "ping"})[0]["pid"] == pid
            except KeeperError:
                return False

        until(answers, timeout=30)
    finally:
        os.kill(pid, 9)


@pytest.mark.parametrize("how", ["job-ended", "no-request"])
def test_a_keeper_process_goes_when_its_job_ends_or_nobody_asks_any_more(short_dir, how):
    """A keeper lives in a session of its own: nothing else stops it. It exits 2 s after its last job
    ended, or after --idle-exit-s with no request even while it holds a job (whose ranks are gone)."""
    address = f"unix:{short_dir / 'gone.sock'}"
    keeper = subprocess.Popen(
        [sys.executable, "-m", "warmstart.checkpoint.keeper", "--listen", address, "--idle-exit-s", "3"]
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client = KeeperClient(address, timeout_s=2.0)
                client.request({"op": "ping"})
                break
            except KeeperError:
                assert time.monotonic() < deadline, "the keeper did not come up"
                time.sleep(0.05)
        _put(client, 6, 5, base=5)
        if how == "job-ended":
            client.request({"op": "end", "job": "j"})
        client.close()
        # a hang guard, not a speed check: the process must end by itself
        assert keeper.wait(timeout=30) == 0
    finally:
        keeper.kill()
        keeper.wait()
