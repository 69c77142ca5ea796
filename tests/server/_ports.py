"""Free TCP ports for test servers (a Cluster needs a block of them, plus its bus ports)."""

from __future__ import annotations

import random
import socket


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int, *, bus: bool = False) -> int:
    """A base port such that base..base+n-1 (and their Cluster bus ports, +10000) are free."""
    for _ in range(200):
        base = random.randrange(20000, 40000)
        ports = [base + i for i in range(n)] + ([base + i + 10000 for i in range(n)] if bus else [])
        if all(port_is_free(p) for p in ports):
            return base
    raise RuntimeError("no free block of ports")
