"""Small helpers shared by tests."""

from __future__ import annotations

import socket


def closed_port_url() -> str:
    """A redis:// URL on a local port nothing listens on (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"
