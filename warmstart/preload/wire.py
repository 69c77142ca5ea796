"""Messages between a process and its preloader: length-prefixed ``marshal`` data over a UNIX socket,
with file descriptors passed alongside (``SCM_RIGHTS``).

``marshal`` and not JSON: it is built in (the start-up hook must not import ``json``, which imports
``re``) and both ends are the same interpreter. Peers are of one user, checked with ``SO_PEERCRED``
on both sides before anything is read.
"""

from __future__ import annotations

import _socket
import marshal
import os
import struct

PROTOCOL = 3
MAX_FDS = 200  # below the kernel's SCM_MAX_FD (253)
_MAX_MESSAGE = 16 << 20
_HEADER = struct.Struct("!I")
_READY_LIMIT = 1 << 20  # a first message (a fingerprint) is a few KiB


class WireError(OSError):
    """The peer went away, or sent something that is no message of this protocol."""


def send(sock, message: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send ``message`` (plain data) and, with its first byte, the descriptors ``fds``."""
    payload = marshal.dumps(message)
    data = _HEADER.pack(len(payload)) + payload
    ancillary = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive(sock) -> tuple[dict, list[int]]:
    """The next message and the descriptors that came with it. Raises :class:`WireError` at the end
    of the stream or on data that is not a message."""
    fds: list[int] = []
    chunk, ancillary, flags, _ = sock.recvmsg(_HEADER.size, _socket.CMSG_SPACE(4 * MAX_FDS))
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    try:
        if flags & getattr(_socket, "MSG_CTRUNC", 8):
            raise WireError("descriptors were cut off")
        header = chunk + _read_exactly(sock, _HEADER.size - len(chunk)) if chunk else b""
        if len(header) < _HEADER.size:
            raise WireError("the peer closed the connection")
        (length,) = _HEADER.unpack(header)
        if length > _MAX_MESSAGE:
            raise WireError(f"a message of {length} bytes")
        message = marshal.loads(_read_exactly(sock, length))
        if not isinstance(message, dict):
            raise WireError("not a message")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def peer_uid(sock) -> int:
    """The user id of the process at the other end (``SO_PEERCRED``)."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))
    return uid


def peer_pid(sock) -> int:
    """The process id of the process at the other end when it connected (``SO_PEERCRED``)."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))
    return pid


def message_ready(sock) -> bool:
    """Whether a whole first message (or the end of the stream) waits on the non-blocking ``sock``:
    what :func:`receive` would then read without waiting. Looked at, not read. Raises
    :class:`WireError` for a message longer than a first message can be."""
    try:
        header = sock.recv(_HEADER.size, _socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True  # the receive says what is wrong
    if len(header) < _HEADER.size:
        return not header  # the end of the stream
    (length,) = _HEADER.unpack(header)
    if length > _READY_LIMIT:
        raise WireError(f"a first message of {length} bytes")
    try:
        return len(sock.recv(_HEADER.size + length, _socket.MSG_PEEK)) == _HEADER.size + length
    except OSError:
        return True


def _read_exactly(sock, n: int) -> bytes:
    parts, left = [], n
    while left > 0:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise WireError("the peer closed the connection")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
