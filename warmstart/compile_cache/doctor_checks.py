"""Environment checks of ``warmstart cache doctor`` that need no cache: the job's temporary directory.

A DataLoader worker hands each batch's tensors to the main process over an ``AF_UNIX`` socket that
multiprocessing creates under ``TMPDIR`` (torch's default ``file_descriptor`` sharing strategy goes
through multiprocessing's resource sharer): ``$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``. Linux
allows 107 bytes for such a path; past that the worker's queue feeder thread fails with "AF_UNIX path
too long", the batch is dropped and the main process waits for it forever. This module owns the
arithmetic and the doctor's wording; ``warmstart.bench`` uses the same arithmetic to keep its
simulated machines' ``TMPDIR`` short.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

AF_UNIX_PATH_MAX = 107
"""Longest ``AF_UNIX`` socket path Linux accepts, in bytes (``sun_path`` is 108 bytes with its NUL)."""

SOCKET_SUFFIX = "/pymp-XXXXXXXX/listener-XXXXXXXX"
"""What multiprocessing appends to the temporary directory for a listener socket: ``mkdtemp(prefix=
'pymp-')`` (``multiprocessing.util.get_temp_dir``), then ``mktemp(prefix='listener-')``
(``multiprocessing.connection.arbitrary_address``); tempfile's random names are 8 characters."""

MAX_TMPDIR_BYTES = AF_UNIX_PATH_MAX - len(SOCKET_SUFFIX)
"""Longest temporary directory whose listener sockets still fit (75 bytes)."""


def longest_socket_path(tmpdir: str | os.PathLike) -> int:
    """Length in bytes of the longest socket path multiprocessing would create under ``tmpdir``."""
    return len(os.fsencode(os.path.abspath(tmpdir))) + len(SOCKET_SUFFIX)


def effective_tmpdir(env: Mapping[str, str] | None = None) -> str:
    """The temporary directory Python's ``tempfile`` (hence multiprocessing) uses with ``env``: the first
    of ``TMPDIR``, ``TEMP``, ``TMP`` that is a writable directory, else the system default."""
    env = os.environ if env is None else env
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = env.get(name, "")
        if value and os.path.isdir(value) and os.access(value, os.W_OK | os.X_OK):
            return os.path.abspath(value)
    for value in ("/tmp", "/var/tmp", "/usr/tmp"):
        if os.path.isdir(value) and os.access(value, os.W_OK | os.X_OK):
            return value
    return tempfile.gettempdir()


def tmpdir_check(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """The doctor's ``TMPDIR`` line: ``(True, detail)`` when DataLoader workers' sockets fit under it,
    ``(False, detail)`` when they do not, with the lengths and what to do (the doctor warns)."""
    tmpdir = effective_tmpdir(env)
    longest = longest_socket_path(tmpdir)
    size = len(os.fsencode(tmpdir))
    if longest <= AF_UNIX_PATH_MAX:
        return True, (
            f"{tmpdir} ({size} bytes): DataLoader workers' sockets under it take up to {longest} of "
            f"the {AF_UNIX_PATH_MAX} bytes AF_UNIX allows"
        )
    return False, (
        f"{tmpdir} is {size} bytes: DataLoader workers hand batches to the main process over a "
        f"socket under it of up to {longest} bytes, over the {AF_UNIX_PATH_MAX}-byte AF_UNIX limit "
        f'("AF_UNIX path too long" in the worker; the batch is lost and the job hangs). Give the '
        f"job a TMPDIR of at most {MAX_TMPDIR_BYTES} bytes, e.g. export TMPDIR=$(mktemp -d "
        f"/tmp/job-XXXXXX), or call torch.multiprocessing.set_sharing_strategy('file_system') in the job"
    )
