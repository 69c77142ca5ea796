"""A free local TCP port, for servers started on this host (benchmarks, tests, the bench command)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick); another process may
    still take it before the caller binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
