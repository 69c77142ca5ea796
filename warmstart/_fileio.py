"""Writing small files atomically with an exact mode (secrets 0600, public keys 0644, tools 0755).

The one place warmstart writes a file that a reader may open at any moment: the server (passwords,
URLs, ACL), the compile cache (keys, stats, Triton's kernels, wrapped compilers, the last run's
name). Neutral ground, so the cache need not import the server.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_file(path: Path, data: str | bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with permissions ``mode``, replacing it atomically.

    The bytes are never readable under a wider mode, not even for an instant: the temporary file is
    created 0600, exclusively and under a random name, and gets ``mode`` exactly once written.
    """
    path = Path(path)
    # A new file of an unpredictable name, created exclusively (O_EXCL, O_NOFOLLOW: never a file or
    # link another user put there), mode 0600 until its mode is set.
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            os.fchmod(handle.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` readable by the owner only (0600), replacing it atomically."""
    write_file(path, data, 0o600)
