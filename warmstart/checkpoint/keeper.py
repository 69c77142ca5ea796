"""The snapshot keeper: a process per node that holds every rank's per-step snapshots in memory, so
that a restarted rank resumes from the step it failed in instead of the last checkpoint.

A keeper outlives the ranks that feed it (it runs in a session of its own: a crash, an OOM kill or
a torchrun restart of the ranks does not touch it) and streams what it receives to a **buddy**: the
keeper of another node, so that losing a whole node loses nothing either. It holds, per job and
rank, a *chain*: the step of the checkpoint it builds on (its base) and, for every snapshot after
it, the embedding rows changed since the snapshot before; the rank's whole small state (dense
weights, optimizer state, RNG, loader position) only for its last few steps. A chain with a gap is
good up to the gap; a snapshot that names a newer base drops what that checkpoint holds. Memory is
bounded (``max_bytes``): a snapshot that does not fit is refused, which leaves a gap.

Frames on the wire (a Unix socket on the node, TCP between buddies): ``WSK3``, a 4-byte header
length, a JSON header naming its payloads' sizes and, on TCP, a nonce and a Poly1305 MAC of header
and payloads under a key derived from the job's key and the nonce (a node's Unix socket only its
user can open: nothing to sign there, and a snapshot of tens of megabytes a step is not hashed four
times over). A torn or unsigned frame is dropped whole.
This module holds the server, its client and ``start_keeper``; what a snapshot contains is
``snapshot``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from warmstart.errors import WarmstartError

log = logging.getLogger("warmstart.checkpoint")

_MAGIC = b"WSK3"
_HEADER = struct.Struct(">4sI")
_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 34
_MAX_FDS = 8
_FRAMING = ("sizes", "shared", "nonce", "mac")
WHOLES_KEPT = 4
"""Whole states kept per rank: ranks finish a step within a step of each other, so the newest step
every rank completed is among each rank's last few."""


class KeeperError(WarmstartError):
    """A keeper could not be reached or refused a request; the message says which and why."""


# -- frames ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SharedPayload:
    """A payload handed over as a memory file (``memfd``) rather than sent: only on a Unix socket,
    where the keeper copies ``size`` bytes out of ``fd`` before it answers. The file must be sealed
    against shrinking (:func:`shared_memory`), so that no later change of it can fault the keeper."""

    fd: int
    size: int

    def __len__(self) -> int:
        return self.size


def shared_memory(nbytes: int) -> tuple[int, Any]:
    """A memory file of ``nbytes`` for :class:`SharedPayload`: its descriptor and a writable map of
    it. ``OSError`` where there are none (not Linux)."""
    import fcntl
    import mmap

    if not hasattr(os, "memfd_create"):
        raise OSError("no memory files on this system")
    fd = os.memfd_create("warmstart-snapshot", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def _send_frame(sock: socket.socket, header: dict[str, Any], payloads: list[Any], secret: bytes | None) -> None:
    # (a frame passed on carries the fields of how it came: they are made anew for this one)
    header = {k: v for k, v in header.items() if k not in _FRAMING} | {"sizes": [len(p) for p in payloads]}
    shared = [i for i, p in enumerate(payloads) if isinstance(p, SharedPayload)]
    if shared:
        if secret is not None or sock.family != socket.AF_UNIX:
            raise KeeperError("memory files are handed over on a node's Unix socket only")
        header["shared"] = shared
    if secret is not None:
        header["nonce"] = os.urandom(16).hex()  # the frame's one-time MAC key derives from it
    body = json.dumps(header, separators=(",", ":")).encode()
    mac = _mac(secret, body, payloads)
    if mac is not None:
        header["mac"] = mac
        body = json.dumps(header, separators=(",", ":")).encode()
    head = _HEADER.pack(_MAGIC, len(body)) + body
    if shared:
        socket.send_fds(sock, [head], [payloads[i].fd for i in shared])  # (a short head: sent whole)
    else:
        sock.sendall(head)
    for payload in payloads:
        if not isinstance(payload, SharedPayload):
            sock.sendall(payload)


def _recv_frame(sock: socket.socket, secret: bytes | None) -> tuple[dict[str, Any], list[bytes]] | None:
    """The next frame, or ``None`` at a clean end of stream.

    Raises:
        KeeperError: a torn, malformed or badly signed frame.
    """
    fds: list[int] = []
    try:
        head = _recv_exact(sock, _HEADER.size, allow_eof=True, fds=fds if sock.family == socket.AF_UNIX else None)
        if head is None:
            return None
        magic, length = _HEADER.unpack(head)
        if magic != _MAGIC or length > _MAX_HEADER:
            raise KeeperError("not a keeper frame")
        header = json.loads(_recv_exact(sock, length))
        sizes = header.get("sizes")
        if not isinstance(sizes, list) or not all(isinstance(s, int) and 0 <= s <= _MAX_PAYLOAD for s in sizes):
            raise KeeperError("malformed frame header")
        shared = header.get("shared", [])
        if shared != sorted(set(shared)) or not all(isinstance(i, int) and 0 <= i < len(sizes) for i in shared):
            raise KeeperError("malformed frame header")
        if len(shared) != len(fds) or (shared and secret is not None):
            raise KeeperError(f"{len(fds)} memory files came with a frame naming {len(shared)}")
        files = dict(zip(shared, fds, strict=True))
        payloads = [
            _read_shared(files[i], size) if i in files else _recv_exact(sock, size, copy=False)
            for i, size in enumerate(sizes)
        ]
        # a sender reuses its memory once it has the answer, or once it gave up waiting for one
        # (closing the connection first): copied while it still waited, the copy is whole
        if files and not _still_connected(sock):
            raise KeeperError("the sender let go of a handed-over payload before it was copied")
    finally:
        for fd in fds:
            os.close(fd)
    if secret is not None:
        mac = header.pop("mac", None)
        unsigned = json.dumps(header, separators=(",", ":")).encode()
        expected = _mac(secret, unsigned, payloads)  # (None: no nonce, not signed by this protocol)
        if not isinstance(mac, str) or expected is None or not hmac.compare_digest(mac, expected):
            raise KeeperError("frame not signed with this job's secret")
    return header, payloads


def _still_connected(sock: socket.socket) -> bool:
    timeout = sock.gettimeout()
    sock.setblocking(False)  # (a socket with a timeout would first wait that long for a byte)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(timeout)


def _read_shared(fd: int, size: int) -> bytes:
    """``size`` bytes out of a memory file a rank handed over: one copy, no socket in between."""
    import fcntl
    import mmap

    try:
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    except OSError:
        sealed = 0
    if not sealed or os.fstat(fd).st_size < size:
        raise KeeperError("a handed-over payload is not a sealed memory file of its size")
    if size == 0:
        return b""
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view, memoryview(view) as data:
        return bytes(data)


def _mac(secret: bytes | None, body: bytes, payloads: list[Any]) -> str | None:
    """Poly1305 of header and payloads, under a one-time key derived from the job's key and the
    frame's nonce (as ChaCha20-Poly1305 derives its Poly1305 keys): a snapshot is tens of megabytes
    a step, and Poly1305 reads them at about 6 GB/s here, BLAKE3 at about 2.5."""
    if secret is None:
        return None
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    nonce = json.loads(body).get("nonce")
    if not isinstance(nonce, str) or len(nonce) != 32:
        return None
    frame_key = hmac.new(hashlib.sha256(b"warmstart keeper frame\0" + secret).digest(), nonce.encode(), "sha256")
    mac = Poly1305(frame_key.digest())
    mac.update(body)
    for payload in payloads:
        mac.update(payload)
    return mac.finalize().hex()


def _recv_exact(
    sock: socket.socket, n: int, *, allow_eof: bool = False, copy: bool = True, fds: list[int] | None = None
) -> Any:
    """``n`` bytes; with ``fds``, the descriptors that came with them are added to it (a Unix
    socket's)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if fds is not None:
            k, ancillary, _, _ = sock.recvmsg_into([view[got:]], socket.CMSG_SPACE(4 * _MAX_FDS))
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
        else:
            k = sock.recv_into(view[got:])
        if k == 0:
            if allow_eof and got == 0:
                return None
            raise KeeperError(f"connection closed {got} bytes into a {n}-byte read (a torn frame)")
        got += k
    return bytes(buf) if copy else buf  # a payload of megabytes is kept as received


# -- addresses ---------------------------------------------------------------------------------------


def _connect(address: str, timeout_s: float) -> socket.socket:
    """``unix:/path`` or ``host:port``."""
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = address[5:]
    else:
        host, _, port = address.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        target = (host.strip("[]") or "127.0.0.1", int(port))
    sock.settimeout(timeout_s)
    try:
        sock.connect(target)
    except OSError:
        sock.close()
        raise
    return sock


def check_address(address: str) -> str:
    """``address`` if it is ``unix:/path`` or ``host:port``.

    Raises:
        KeeperError: anything else, naming what is accepted.
    """
    if address.startswith("unix:") and len(address) > 5:
        return address
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and int(port) < 65536:  # port 0: listen on any free one
        return address
    raise KeeperError(f"keeper address {address!r}: expected unix:/path/to/socket or host:port")


# -- what a keeper holds -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Entry:
    since: int
    """The step of the snapshot this one follows (its rows are those touched after it)."""
    full: bool
    rows: bytes


@dataclasses.dataclass
class _Chain:
    """One rank's snapshots: each step's rows since the snapshot before, whole states of the last
    few steps, on top of a committed checkpoint (``base``)."""

    base: int
    """The committed checkpoint step the chain builds on (-1: none; a full snapshot starts it)."""
    entries: dict[int, _Entry] = dataclasses.field(default_factory=dict)
    wholes: OrderedDict[int, bytes] = dataclasses.field(default_factory=OrderedDict)

    def size(self) -> int:
        return sum(len(e.rows) for e in self.entries.values()) + sum(map(len, self.wholes.values()))

    def good_run(self) -> list[int]:
        """The steps of the chain's good run, in order: it starts at a full snapshot or one that follows
        the base, and each next step follows the one before. A gap ends it."""
        run: list[int] = []
        for step in sorted(self.entries):
            entry = self.entries[step]
            if entry.full or (not run and entry.since <= self.base):
                run = [step]
            elif run and entry.since == run[-1]:
                run.append(step)
            elif run:
                break
        return run

    def restorable(self) -> list[int]:
        """The steps this rank can be restored to: those of the good run with a whole state."""
        return [s for s in self.good_run() if s in self.wholes]

    def rebase(self, base: int) -> None:
        """A checkpoint of ``base`` is durable: what came before it is not needed any more."""
        self.base = base
        for step in [s for s in self.entries if s <= base]:
            del self.entries[step]
        for step in [s for s in self.wholes if s <= base]:
            del self.wholes[step]


class _Store:
    """Chains of every (job, rank), under one lock and one memory bound."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.jobs: dict[str, dict[int, _Chain]] = {}
        self.worlds: dict[str, int] = {}
        self.refused = 0

    def put(self, h: dict[str, Any], rows: bytes, whole: bytes) -> str | None:
        """Stores one step of one rank; the reason it was refused, or ``None``."""
        job, rank, step, base = str(h["job"]), int(h["rank"]), int(h["step"]), int(h["base"])
        since, full = int(h["since"]), bool(h.get("full"))
        if since >= step:
            raise KeeperError(f"step {step} cannot follow step {since}")
        with self.lock:
            self.worlds[job] = int(h["world"])
            chains = self.jobs.setdefault(job, {})
            chain = chains.get(rank)
            if chain is None or base < chain.base:  # a new run of the job, from an older checkpoint
                chain = chains[rank] = _Chain(base=base)
            elif base > chain.base:
                chain.rebase(base)
            # a restarted rank goes on from an earlier step: what the failed run kept after it is void
            for later in [s for s in chain.entries if s > since]:
                del chain.entries[later]
            for later in [s for s in chain.wholes if s > since]:
                del chain.wholes[later]
            if self._size() + len(rows) + len(whole) > self.max_bytes:
                self.refused += 1
                return f"the keeper's memory bound ({self.max_bytes} bytes) is reached"
            chain.entries[step] = _Entry(since=since, full=full, rows=rows)
            if len(whole):  # (a buddy catching up is sent the rows of older steps without their whole)
                chain.wholes[step] = whole
            while len(chain.wholes) > WHOLES_KEPT:
                chain.wholes.popitem(last=False)
            return None

    def _size(self) -> int:
        return sum(c.size() for cs in self.jobs.values() for c in cs.values())

    def status(self, job: str) -> dict[str, Any]:
        with self.lock:
            chains = self.jobs.get(job, {})
            return {
                "world": self.worlds.get(job),
                "ranks": {
                    str(rank): {"base": c.base, "restorable": c.restorable(), "bytes": c.size()}
                    for rank, c in sorted(chains.items())
                },
                "held_bytes": self._size(),
                "max_bytes": self.max_bytes,
                "refused": self.refused,
            }

    def replay(self, job: str, rank: int) -> list[tuple[dict[str, Any], list[Any]]]:
        """The puts that rebuild one rank's good run elsewhere, oldest first (a whole state only with
        the steps that have one here)."""
        with self.lock:
            chain = self.jobs.get(job, {}).get(rank)
            if chain is None:
                return []
            world = self.worlds.get(job)
            return [
                (
                    {"op": "put", "job": job, "rank": rank, "world": world, "step": step, "base": chain.base}
                    | {"since": chain.entries[step].since, "full": chain.entries[step].full},
                    [chain.entries[step].rows, chain.wholes.get(step, b"")],
                )
                for step in chain.good_run()
            ]

    def get(self, job: str, rank: int, step: int) -> tuple[dict[str, Any], list[bytes]]:
        with self.lock:
            chain = self.jobs.get(job, {}).get(rank)
            if chain is None or step not in chain.restorable():
                raise KeeperError(f"rank {rank} of job {job!r} cannot be restored to step {step} here")
            run = chain.good_run()
            steps = run[: run.index(step) + 1]
            return {"base": chain.base, "steps": steps}, [chain.entries[s].rows for s in steps] + [chain.wholes[step]]

    def end(self, job: str) -> None:
        with self.lock:
            self.jobs.pop(job, None)
            self.worlds.pop(job, None)


# -- the server --------------------------------------------------------------------------------------


class Keeper:
    """A keeper serving ``listen`` addresses until :meth:`stop` (or, run as a process, until it has
    had no request for ``idle_exit_s``, or its last job ended).

    Args:
        listen: ``unix:/path`` and/or ``host:port`` (port 0: any free one; see :attr:`addresses`).
        max_bytes: the most snapshot bytes held, all jobs together.
        buddy: another node's keeper, which gets a copy of everything this one is sent.
        secret: the key frames on TCP are signed with (required to listen on TCP or use a buddy).
        idle_exit_s: as a process, exit after this long without a request, jobs held or not.
        end_exit_s: as a process, exit this long after the last job it held ended (unless another
            request comes): a job's keeper goes with the job.
        idle_streams: take in and pass on snapshots only on CPU time nothing else wants (Linux's
            ``SCHED_IDLE`` for the threads that serve a stream of puts, and the buddy's copies), while
            what a starting rank waits for (a status, a fetch) is answered at the keeper's priority.
    """

    def __init__(
        self,
        listen: list[str],
        *,
        max_bytes: int = 2 << 30,
        buddy: str | None = None,
        secret: bytes | None = None,
        idle_exit_s: float = 600.0,
        end_exit_s: float = 2.0,
        idle_streams: bool = False,
    ) -> None:
        if secret is None and (buddy or any(not a.startswith("unix:") for a in listen)):
            raise KeeperError(
                "a keeper on TCP (or with a buddy) needs a secret: "
                "set WARMSTART_SECRET, or WARMSTART_KEY_FILE to a private key"
            )
        self.store = _Store(max_bytes)
        self.secret = secret
        self.idle_exit_s = idle_exit_s
        self.end_exit_s = end_exit_s
        self.idle_streams = idle_streams
        self._ended = False  # a job ended and none is held
        self.addresses: list[str] = []
        self._listeners: list[socket.socket] = []
        self._stop = threading.Event()
        self._last_request = time.monotonic()
        self._buddy = _BuddyLink(buddy, secret, self.store, idle_streams) if buddy else None
        for address in listen:
            self._listen(check_address(address))

    def _listen(self, address: str) -> None:
        if address.startswith("unix:"):
            path = address[5:]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o077)  # only this user may hand it state, or read it back
            try:
                sock.bind(path)
            finally:
                os.umask(old)
            self.addresses.append(address)
        else:
            host, _, port = address.rpartition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), int(port)))
            self.addresses.append(f"{host}:{sock.getsockname()[1]}")
        sock.listen(64)
        self._listeners.append(sock)

    def start(self) -> Keeper:
        """Serve in background threads; returns at once."""
        for sock in self._listeners:
            threading.Thread(target=self._accept, args=(sock,), name="warmstart-keeper-accept", daemon=True).start()
        return self

    def serve_forever(self) -> None:
        """Serve until stopped, ``idle_exit_s`` without a request, or ``end_exit_s`` after the last
        job it held ended."""
        self.start()
        while not self._stop.wait(1.0):
            with self.store.lock:
                empty = not self.store.jobs
            idle = time.monotonic() - self._last_request
            # with no request for idle_exit_s, its jobs' ranks are gone for good (or will resume from
            # their checkpoints): their snapshots are not held for ever
            if idle > self.idle_exit_s or (empty and self._ended and idle > self.end_exit_s):
                break
        self.stop()

    def stop(self) -> None:
        """Stop listening and forwarding."""
        self._stop.set()
        for sock in self._listeners:
            with contextlib.suppress(OSError):
                sock.close()
        for address in self.addresses:
            if address.startswith("unix:"):
                with contextlib.suppress(OSError):
                    os.unlink(address[5:])
        if self._buddy is not None:
            self._buddy.stop()

    def _accept(self, listener: socket.socket) -> None:
        secret = None if listener.family == socket.AF_UNIX else self.secret  # see the module docstring
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            thread = threading.Thread(
                target=self._serve, args=(conn, secret), name="warmstart-keeper-conn", daemon=True
            )
            thread.start()

    def _serve(self, conn: socket.socket, secret: bytes | None) -> None:
        idle = False
        with conn:
            while True:
                try:
                    frame = _recv_frame(conn, secret)
                except (KeeperError, OSError, ValueError) as exc:
                    log.warning("warmstart: keeper dropped a frame (%s)", exc)
                    return
                if frame is None:
                    return
                self._last_request = time.monotonic()
                header, payloads = frame
                if self.idle_streams and not idle and header.get("op") == "put":
                    idle = _idle_thread()  # a rank's (or a keeper's) stream of snapshots from here on
                try:
                    reply, out = self._handle(header, payloads)
                except (KeeperError, KeyError, TypeError, ValueError) as exc:
                    reply, out = {"ok": False, "why": str(exc)}, []
                if header.get("op") == "put" and header.get("noreply"):
                    continue
                try:
                    _send_frame(conn, reply, out, secret)
                except OSError:
                    return

    def _handle(self, h: dict[str, Any], payloads: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        op = h.get("op")
        if op == "put":
            rows, whole = payloads
            why = self.store.put(h, rows, whole)
            if why is None and self._buddy is not None and not h.get("replica"):
                self._buddy.forward(h, payloads)
            return ({"ok": True} if why is None else {"ok": False, "why": why}), []
        if op == "status":
            status = self.store.status(str(h["job"]))
            if self._buddy is not None:
                status["buddy"] = self._buddy.state()
            return {"ok": True, **status}, []
        if op == "get":
            reply, out = self.store.get(str(h["job"]), int(h["rank"]), int(h["step"]))
            return {"ok": True, **reply}, out
        if op == "end":
            self.store.end(str(h["job"]))
            with self.store.lock:
                self._ended = not self.store.jobs
            if self._buddy is not None and not h.get("replica"):
                self._buddy.forward(h, [])
            return {"ok": True}, []
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}, []
        raise KeeperError(f"unknown request {op!r}")


class _BuddyLink:
    """Copies of this keeper's requests to the buddy, from one thread, never blocking a request: a
    queue bounded in bytes, dropped (with one warning) while the buddy is slow or gone. A rank whose
    snapshot was dropped has a gap on the buddy: its next snapshot that fits goes with the rank's
    whole good run as this keeper holds it (a replay), so the buddy's copy is whole again."""

    MAX_QUEUED = 256 << 20
    RETRY_S = 2.0

    def __init__(self, address: str, secret: bytes | None, store: _Store, idle: bool = False) -> None:
        self.address = check_address(address)
        self.idle = idle
        self.secret = secret
        self.store = store
        self.behind: set[tuple[str, int]] = set()
        """(job, rank) whose copy on the buddy has a gap: the next put replays the rank's chain."""
        self.queue: queue.Queue = queue.Queue()
        self.queued = 0
        self.dropped = 0
        self.sent = 0
        self.warned = False
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.down_until = 0.0
        self.thread = threading.Thread(target=self._run, name="warmstart-keeper-buddy", daemon=True)
        self.thread.start()

    def forward(self, header: dict[str, Any], payloads: list[Any]) -> None:
        key = (str(header.get("job")), int(header.get("rank", -1)))
        with self.lock:
            if header.get("op") == "end":
                self.behind = {k for k in self.behind if k[0] != key[0]}
            replay = header.get("op") == "put" and key in self.behind
        items = self.store.replay(*key) if replay else [(header, payloads)]
        size = sum(len(p) for _, ps in items for p in ps)
        with self.lock:
            if not items or self.queued + size > self.MAX_QUEUED or time.monotonic() < self.down_until:
                self.dropped += 1
                if header.get("op") == "put":
                    self.behind.add(key)
                self._warn_once("slow or unreachable")
                return
            self.behind.discard(key)
            self.queued += size
        for h, ps in items:
            n = sum(map(len, ps))
            self.queue.put(({**h, "replica": True, "noreply": h.get("op") == "put"}, ps, n))

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {
                "address": self.address,
                "sent": self.sent,
                "dropped": self.dropped,
                "queued_bytes": self.queued,
                "behind": len(self.behind),
            }

    def stop(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        if self.idle:
            _idle_thread()
        while True:
            item = self.queue.get()
            if item is None:
                return
            header, payloads, size = item
            try:
                if self.sock is None:
                    self.sock = _connect(self.address, timeout_s=5.0)
                    self.sock.settimeout(30.0)
                _send_frame(self.sock, header, payloads, self.secret)
                if not header.get("noreply"):
                    _recv_frame(self.sock, self.secret)
                with self.lock:
                    self.sent += 1
            except (OSError, KeeperError) as exc:
                with self.lock:
                    self.dropped += 1
                    self.down_until = time.monotonic() + self.RETRY_S
                    if header.get("op") == "put":
                        self.behind.add((str(header["job"]), int(header["rank"])))
                self._warn_once(f"{type(exc).__name__}: {exc}")
                if self.sock is not None:
                    with contextlib.suppress(OSError):
                        self.sock.close()
                    self.sock = None
            finally:
                with self.lock:
                    self.queued -= size

    def _warn_once(self, why: str) -> None:
        if not self.warned:
            self.warned = True
            log.warning(
                "warmstart: snapshot buddy %s %s: its copy stops at the last step it got (a node loss "
                "falls back to the keeper's or the checkpoint's step)",
                self.address,
                why,
            )


# -- the client --------------------------------------------------------------------------------------


class KeeperClient:
    """One connection to a keeper, for one rank's requests (not thread-safe: one caller at a time).

    Args:
        address: ``unix:/path`` or ``host:port``.
        secret: the job's key, as the keeper's (frames on TCP are signed with it).
        timeout_s: the most one request may take before it fails with :class:`KeeperError`.
    """

    def __init__(self, address: str, *, secret: bytes | None = None, timeout_s: float = 10.0) -> None:
        self.address = check_address(address)
        self.secret = None if address.startswith("unix:") else secret  # see the module docstring
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def request(self, header: dict[str, Any], payloads: list[bytes] = ()) -> tuple[dict[str, Any], list[bytes]]:  # type: ignore[assignment]
        """Send one request and return the keeper's reply.

        Raises:
            KeeperError: unreachable, timed out, torn, or refused (``ok`` false), with the reason.
        """
        try:
            if self._sock is None:
                self._sock = _connect(self.address, self.timeout_s)
            _send_frame(self._sock, header, list(payloads), self.secret)
            frame = _recv_frame(self._sock, self.secret)
        except (OSError, KeeperError, ValueError) as exc:
            self.close()
            raise KeeperError(f"keeper {self.address}: {exc or type(exc).__name__}") from exc
        if frame is None:
            self.close()
            raise KeeperError(f"keeper {self.address} closed the connection")
        reply, out = frame
        if not reply.get("ok"):
            raise KeeperError(f"keeper {self.address} refused {header.get('op')}: {reply.get('why')}")
        return reply, out

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


def start_keeper(
    address: str,
    *,
    buddy: str | None = None,
    max_bytes: int | None = None,
    secret: bytes | None = None,
    timeout_s: float = 10.0,
    environ: dict[str, str] | None = None,
    log_path: Path | None = None,
    wait: bool = True,
) -> int | None:
    """Start a keeper process listening on ``address`` in a session of its own (so that it outlives
    its starter and the starter's launcher), unless one answers there already. Returns the new
    process's pid, or ``None`` when one was running. The keeper takes its secret from ``environ``
    (default this process's), as every warmstart process does (:func:`keeper_secret`); ``secret`` must
    be the same key. Its output goes to ``log_path`` (default ``<socket>.log``; a TCP keeper's
    nowhere), never to the starter's. ``wait=False`` returns once the process is started, before it
    answers (a rank's first snapshot waits for it on its sending thread): a restart does not spend
    the keeper's start-up on its way to its first step.

    Raises:
        KeeperError: it did not answer within ``timeout_s`` (with ``wait``).
    """
    try:
        KeeperClient(address, secret=secret, timeout_s=1.0).request({"op": "ping"})
        return None
    except KeeperError:
        pass
    args = [sys.executable, "-m", "warmstart.checkpoint.keeper", "--listen", address]
    if buddy:
        args += ["--buddy", buddy]
    if max_bytes:
        args += ["--max-bytes", str(max_bytes)]
    # the keeper reads the secret from the same environment (WARMSTART_SECRET[_FILE])
    env = dict(os.environ if environ is None else environ)
    # it receives megabytes a step: glibc keeps what it frees for the next (instead of handing it back
    # and faulting it in again, page by page), up to the size of a whole snapshot of the largest jobs
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))  # at most this much kept unused
    # Never the starter's own output: a launcher (or a test) waits for its pipes to close, and a
    # keeper outlives it. Its warnings go to a log beside its socket.
    if log_path is None:
        log_path = Path(address[5:] + ".log" if address.startswith("unix:") else os.devnull)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            args,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
            close_fds=True,
        )
    if not wait:
        return proc.pid
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KeeperError(f"the keeper for {address} exited at start with status {proc.returncode}")
        try:
            KeeperClient(address, secret=secret, timeout_s=1.0).request({"op": "ping"})
            return proc.pid
        except KeeperError:
            time.sleep(0.05)
    proc.kill()
    raise KeeperError(f"the keeper for {address} did not answer within {timeout_s:g} s")


def keeper_secret(settings: Any) -> bytes | None:
    """The key keepers and ranks sign their frames with: the job's ``WARMSTART_SECRET``, else one
    derived from its private signing key (``WARMSTART_KEY_FILE``); ``None`` with neither (then a
    keeper serves only its node's Unix socket, which only its user can open)."""
    if settings.secret:
        return settings.secret
    if settings.key_file is not None:
        try:
            pem = Path(settings.key_file).read_bytes()
        except OSError:
            return None
        if b"PRIVATE KEY" in pem:
            return hashlib.sha256(b"warmstart snapshot keeper\0" + pem).digest()
    return None


def _idle_thread() -> bool:
    """The calling thread runs only on CPU time nothing else wants (Linux: per thread; allowed to any
    user). Whether it does."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> None:
    """``python -m warmstart.checkpoint.keeper --listen ADDR [--listen ADDR] [--buddy ADDR] [--max-bytes N]``"""
    parser = argparse.ArgumentParser(prog="python -m warmstart.checkpoint.keeper", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", action="append", required=True, help="unix:/path or host:port (repeatable)")
    parser.add_argument("--buddy", help="another node's keeper (host:port) that gets a copy of everything")
    parser.add_argument("--max-bytes", type=int, default=2 << 30, help="the most snapshot bytes held")
    parser.add_argument("--idle-exit-s", type=float, default=600.0, help="exit after this long with no request")
    parser.add_argument("--ready-file", type=Path, help="write the addresses listened on here once listening")
    parser.add_argument(
        "--priority",
        choices=("idle", "low", "normal"),
        default="idle",
        help="CPU priority: idle (nice 10, and snapshots taken in and passed on only on CPU time the ranks "
        "leave; the default), low (nice 10), normal",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # the training steps come first on a busy node: a keeper behind takes fewer snapshots, the ranks
    # never wait for it (set before the keeper's threads start, which inherit it)
    if args.priority != "normal":
        with contextlib.suppress(OSError):
            os.nice(10)
    from warmstart.config import Settings

    try:
        keeper = Keeper(
            args.listen,
            max_bytes=args.max_bytes,
            buddy=args.buddy,
            secret=keeper_secret(Settings.from_env()),
            idle_exit_s=args.idle_exit_s,
            idle_streams=args.priority == "idle",
        )
    except (WarmstartError, OSError) as exc:
        print(f"warmstart keeper: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.ready_file is not None:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text("\n".join(keeper.addresses) + "\n")
        tmp.replace(args.ready_file)
    keeper.serve_forever()


if __name__ == "__main__":
    main()
