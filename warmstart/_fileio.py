"""Writing small files atomically with an exact mode (secrets 0600, public keys 0644).

Neutral ground: both ``warmstart.server`` (passwords, URLs, ACL) and ``warmstart.compile_cache``
(``signing.generate_key_pair``) write such files, and the cache must not import the server.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_file(path: Path, data: str | bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with permissions ``mode``, replacing it atomically.

    The bytes are never readable under a wider mode, not even for an instant: the temporary file
    is created with ``mode`` (narrowed by the umask, then set exactly) before anything is written.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode & 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)  # the umask or an existing file may have left it otherwise
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` readable by the owner only (0600), replacing it atomically."""
    write_file(path, data, 0o600)
